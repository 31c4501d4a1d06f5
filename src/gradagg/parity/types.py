"""The data of ``gradagg parity``, in one leaf module: every other module of the package imports these,
and this one imports nothing of the package.

:class:`Piece` (a rank's part of a DTensor gradient), :class:`RankResult` (what a rank hands back),
:class:`TruthResult` (what the process that computes the truth hands back), :class:`Truth`,
:class:`Unread` and :class:`Miss` (the comparison), :class:`ParityReport` (the outcome).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Layout = tuple[int, ...]
"""Microbatches per rank: ``(4,)`` one process running 4, ``(1, 3)`` two ranks (see :mod:`gradagg.parity.layouts`)."""

# Below 1% of the whole gradient's norm a parameter is judged against that 1%: float32 round-off of
# a parameter is about 1e-5 of the whole norm on the examples (error 7e-5 on a layer at 6% of it), so
# its relative error stays under the float32 tolerance; a real miss by a factor k on a parameter of
# size s * ||T|| still shows as |k - 1| * s / 0.01, caught down to s ~ 1e-5 in float32.
FLOOR = 1e-2


@dataclass(frozen=True)
class Unread:
    """A gradient a rank holds that cannot be compared, and why: it fails whatever the tolerance.

    Attributes:
        why: a sentence that names the parameter, e.g. "'w' is a DTensor gradient (S(0)) here but has none
            on rank 0: ...".
    """

    why: str


@dataclass(frozen=True)
class Truth:
    """The one-process full-batch gradients, with their norms and the floor of the relative error.

    ``roundoff``: the relative error that round-off alone can reach in what the full batch computes in (the
    lowest-precision floating dtype of its forward, see ``gradagg.parity.compare.RTOL_BY_DTYPE``); 0 when unknown.
    """

    grads: dict[str, torch.Tensor | None]
    norms: dict[str, float]
    floor: float
    roundoff: float = 0.0
    computes_in: str = ""

    @classmethod
    def of(cls, grads: dict[str, torch.Tensor | None], computes_in: str = "", roundoff: float = 0.0) -> Truth:
        """Wrap the truth's gradients (name -> tensor or None), and what it computes in (``"torch.float32"``)."""
        norms = {n: float(g.double().norm()) for n, g in grads.items() if g is not None}
        return cls(grads, norms, FLOOR * math.sqrt(sum(v * v for v in norms.values())), roundoff, computes_in)

    def scale(self, name: str) -> float:
        """What an error on ``name`` is relative to: its truth's norm, or the floor when that is larger."""
        return max(self.norms.get(name, 0.0), self.floor)


@dataclass(frozen=True)
class Miss:
    """One parameter on one rank: its relative error (inf: not comparable, nan: not finite) and why."""

    name: str
    rank: int
    error: float
    problem: str | None = None

    @property
    def key(self) -> float:
        """Sort key: NaN counts as the worst."""
        return math.inf if math.isnan(self.error) else self.error


@dataclass(frozen=True)
class Piece:
    """One rank's part of a DTensor gradient.

    Attributes:
        local: the rank's local tensor (a CPU copy).
        shape: the whole tensor's shape.
        placements: one per mesh dimension: ``"S(0)"``, ``"R"``, ``"P(sum)"``, or the repr of another.
        mesh: the mesh's global ranks, row-major.
        mesh_shape: the mesh's shape.
        coordinate: this rank's coordinate in the mesh.
    """

    local: torch.Tensor
    shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...]

    @property
    def spec(self) -> tuple[Any, ...]:
        """What every rank of the mesh must agree on."""
        return self.shape, self.placements, self.mesh, self.mesh_shape


@dataclass
class FlatPiece:
    """One rank's piece of an FSDP1 gradient (``use_orig_params=True``): FSDP1 flattens the parameters of a unit
    into one flat parameter, shards it in consecutive pieces over its group in rank order, and leaves each original
    parameter (and its ``.grad``) the 1-d part of itself that falls in this rank's piece (empty on some ranks).

    Attributes:
        local: this rank's part of the gradient (a CPU copy), or None where ``.grad`` is None here.
        size: the parameter's part here, in elements (0: none of it on this rank).
        shape: the whole parameter's shape (read before ``prepare`` wrapped the model).
        group: the global ranks of the FSDP1 unit's group, in its order (one replica under the hybrid strategies).
    """

    local: torch.Tensor | None
    size: int
    shape: tuple[int, ...]
    group: tuple[int, ...]


@dataclass
class RankResult:
    """What one rank hands back.

    Attributes:
        rank: the rank.
        failure: None when every phase returned; else ``"step() raised ZeroDivisionError: ..."``.
        model_digest: digest of the model ``build_model()`` gave on this rank, before ``prepare``.
        window_digest: digest of the window ``microbatches()`` gave on this rank.
        grads: parameter name -> gradient after ``step`` (None: no gradient; a :class:`Piece`: this rank's
            shard of a DTensor; a :class:`FlatPiece`: this rank's piece of an FSDP1 gradient; an :class:`Unread`:
            what cannot be read), in ``named_parameters()`` order.
        computes_in: the lowest-precision dtype ``torch.autocast`` ran the step's operations in (``"torch.bfloat16"``);
            "" where autocast was off.
    """

    rank: int
    failure: str | None = None
    model_digest: dict[str, str] = field(default_factory=dict)
    window_digest: str = ""
    grads: dict[str, torch.Tensor | Piece | FlatPiece | Unread | None] = field(default_factory=dict)
    computes_in: str = ""


@dataclass(frozen=True)
class TruthResult:
    """What the process that checks SCRIPT.py and computes the truth hands back.

    Attributes:
        failure: None when the script is usable; else why not (the :class:`~gradagg.errors.ScriptError` text).
        window: M, the microbatches that ``microbatches()`` returned.
        grads: parameter name -> the full batch's gradient (a CPU copy), or None where it gives none.
        model_digest: digest of the model, before the backward (every rank must reproduce it).
        window_digest: digest of the window (likewise).
        computes_in: the lowest-precision floating dtype among the results of the torch operations of
            ``full_batch_loss()`` (``"torch.float32"`` for a float64 model whose loss casts its logits to float32).
    """

    failure: str | None = None
    window: int = 0
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    model_digest: dict[str, str] = field(default_factory=dict)
    window_digest: str = ""
    computes_in: str = ""


class Verdict:
    """What a report of observations says: passed when every observation passed, and its JSON form."""

    observations: list[dict[str, Any]]

    @property
    def passed(self) -> bool:
        """Whether every observation (a layout, a cell) passed."""
        return all(o["passed"] for o in self.observations)

    @property
    def json(self) -> dict[str, Any]:
        """``{"observations": [...], "passed": bool}``: what ``gradagg parity`` prints."""
        return {"observations": self.observations, "passed": self.passed}


@dataclass(frozen=True)
class ParityReport(Verdict):
    """The outcome of :func:`check_parity`.

    Attributes:
        script: SCRIPT.py's path.
        window: M, the microbatches that ``microbatches()`` returned.
        dtype: the lowest-precision dtype the full batch computes in: its gradients' or lower (a loss that casts
            to float32); what the default rtol is for.
        rtol: the tolerance used.
        observations: one per layout, in the ``gradagg verify`` form (see :func:`check_parity`).
        elapsed_s: seconds the whole check took.
    """

    script: str
    window: int
    dtype: str
    rtol: float
    observations: list[dict[str, Any]]
    elapsed_s: float
