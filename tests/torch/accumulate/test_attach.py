"""acc.attach(optimizer) with the frameworks' own optimizer wrappers, and with a step called with a closure.

One process (no group). Each case runs windows of float64 microbatches through the wrapper and compares the
parameters with a plain loop that averages the window's gradients by hand and steps a twin optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from gradagg.errors import WindowError
from gradagg.torch import MicrobatchAccumulator

TOL = 1e-12  # float64: a mean of <= 3 microbatch gradients, summed in another order than the reference
WINDOWS = [3, 3, 2]  # microbatches per optimizer step, the last window short


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(2, 3, generator=g, dtype=torch.float64), torch.randn(2, 1, generator=g, dtype=torch.float64))
        for _ in range(n)
    ]


def loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((model(b[0]) - b[1]) ** 2).mean()


def windows() -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    data, at = batches(sum(WINDOWS)), 0
    for k in WINDOWS:
        yield data[at : at + k]
        at += k


def reference(make_opt: Callable[[nn.Module], Any], clip: float | None = None) -> dict[str, torch.Tensor]:
    """The plain loop: each window's gradient = the mean of its microbatch gradients, clipped, then a step."""
    model = net()
    opt = make_opt(model)
    for win in windows():
        for b in win:
            (loss(model, b) / len(win)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def error(model: nn.Module, want: dict[str, torch.Tensor]) -> float:
    return max(float((p.detach() - want[n]).abs().max()) for n, p in model.named_parameters())


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5)


def run(model: nn.Module, acc: MicrobatchAccumulator, step: Callable[[], object], zero: Callable[[], object]) -> None:
    for win in windows():
        for b in win:
            with acc.microbatch():
                loss(model, b).backward()
        step()
        zero()


def test_accelerated_optimizer(accelerator: Any) -> None:
    """Accelerate's wrapper never calls Optimizer.__init__ (no hook registry of its own): attach hooks the
    torch optimizer in its ``optimizer`` attribute; each step is the window mean, the short window's by 2."""
    from accelerate.optimizer import AcceleratedOptimizer

    model = net()
    wrapped = AcceleratedOptimizer(sgd(model), device_placement=False)
    acc = MicrobatchAccumulator(model)
    acc.attach(wrapped)
    run(model, acc, wrapped.step, wrapped.zero_grad)
    assert error(model, reference(sgd)) <= TOL
    assert acc.ledger.divisor == 2


def test_torchtitan_container() -> None:
    """torchtitan's OptimizersContainer holds one optimizer per parameter group (here Adam for the biases,
    AdamW for the rest): the first one's step finishes the window, the second finds it finished."""
    optimizer = pytest.importorskip("torchtitan.components.optimizer.optimizer")
    groups = [
        optimizer.ParamGroupConfig(pattern=r"bias$", optimizer_name="Adam", optimizer_kwargs={"lr": 0.05}),
        optimizer.ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.02}),
    ]
    config = optimizer.OptimizersContainer.Config(param_groups=groups, implementation="for-loop")

    def container(model: nn.Module) -> Any:
        return optimizer.OptimizersContainer(config, model_parts=[model])

    model = net()
    opts = container(model)
    assert len(opts.optimizers) == 2
    acc = MicrobatchAccumulator(model)
    acc.attach(opts)
    run(model, acc, opts.step, lambda: opts.zero_grad(set_to_none=True))
    assert error(model, reference(container)) <= TOL


def test_lightning_automatic_optimisation(tmp_path: Any) -> None:
    """Lightning, automatic optimisation, accumulate_grad_batches=3 over 8 batches (windows 3, 3, 2) and
    gradient_clip_val: the backward hook runs each microbatch inside acc.microbatch(); the window's last one
    runs in the step's closure, after the step pre-hooks; Lightning clips inside that closure, where the
    attached accumulator finishes first, so the clip and the step see the exact window mean."""
    pl = pytest.importorskip("lightning.pytorch")
    clip = 0.05  # small enough that every window's gradient is clipped

    class Module(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = net()
            self.acc = MicrobatchAccumulator(self.net)

        def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
            return loss(self.net, batch)

        def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            with self.acc.microbatch():
                (loss * self.trainer.accumulate_grad_batches).backward()  # undo Lightning's division by k

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.net.parameters(), lr=0.3, momentum=0.5)

        def on_train_start(self) -> None:
            self.acc.attach(self.optimizers())  # a LightningOptimizer

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(batches(sum(WINDOWS)), batch_size=None)  # the batches as they are

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=3,
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module)
    want = reference(sgd, clip=clip)
    assert error(module.net, want) <= TOL


def test_step_with_a_closure() -> None:
    """optimizer.step(closure) with the window's last microbatch inside the closure: finish comes after it."""
    model = net()
    opt = sgd(model)
    acc = MicrobatchAccumulator(model)
    acc.attach(opt)
    for win in windows():
        for b in win[:-1]:
            with acc.microbatch():
                loss(model, b).backward()

        def closure(last: Any = win[-1]) -> torch.Tensor:
            with acc.microbatch():
                out = loss(model, last)
                out.backward()
            return out

        opt.step(closure)
        opt.zero_grad()
    assert error(model, reference(sgd)) <= TOL


class BareWrapper(torch.optim.Optimizer):
    """A wrapper like Accelerate's (no Optimizer.__init__), keeping its optimizer under a name attach does not know."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.inner.step(closure)


def test_unknown_wrapper_falls_back_to_its_step() -> None:
    """No hook registry and no known inner attribute: attach replaces the instance's step; remove() restores it."""
    model = net()
    wrapped = BareWrapper(sgd(model))
    acc = MicrobatchAccumulator(model)
    handle = acc.attach(wrapped)
    assert "step" in vars(wrapped)
    run(model, acc, wrapped.step, lambda: wrapped.inner.zero_grad())
    assert error(model, reference(sgd)) <= TOL
    handle.remove()
    assert "step" not in vars(wrapped)


def test_container_finishes_once_per_step() -> None:
    """A container of two optimizers, attached: one window, one finish (a second would find M = 0 and raise)."""
    optimizer = pytest.importorskip("torchtitan.components.optimizer.optimizer")
    model = net()
    groups = [
        optimizer.ParamGroupConfig(pattern=r"bias$", optimizer_name="Adam"),
        optimizer.ParamGroupConfig(pattern=r".*", optimizer_name="AdamW"),
    ]
    opts = optimizer.OptimizersContainer(
        optimizer.OptimizersContainer.Config(param_groups=groups, implementation="for-loop"), model_parts=[model]
    )
    acc = MicrobatchAccumulator(model)
    acc.attach(opts)
    with acc.microbatch():
        loss(model, batches(1)[0]).backward()
    opts.step()
    assert acc.ledger.microbatches_global == 1
    opts.zero_grad()
    with pytest.raises(WindowError, match="M = 0"):
        opts.step()  # attached: a step with no microbatch finishes an empty window, which refuses


def test_twin_reference_is_not_trivial() -> None:
    """The known wrong fix (the short last window divided by 3, as Accelerate's accumulate does) is caught."""
    model = net()
    opt = sgd(model)
    for win in windows():
        for b in win:
            (loss(model, b) / 3).backward()
        opt.step()
        opt.zero_grad()
    assert error(model, reference(sgd)) > 1e-6


@pytest.mark.parametrize("steps", [2, 3])
def test_attach_refuses_accelerate_dividing(steps: int) -> None:
    """The general attach() under Accelerate with gradient_accumulation_steps > 1: accelerator.backward divides
    the summed loss by it, so the window's gradient was 1/steps of the mean, silently. Refused at attach(),
    naming exact(); exact()'s accumulator (which undoes the division) attaches the same optimizer."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from gradagg.errors import GradaggError
    from gradagg.integrations.accelerate import exact

    try:
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=steps)
        model, opt = accelerator.prepare(net(), torch.optim.SGD(net().parameters(), lr=0.1))
        acc = MicrobatchAccumulator(model)
        with pytest.raises(GradaggError, match=r"gradagg\.integrations\.accelerate\.exact") as info:
            acc.attach(opt)
        assert f"gradient_accumulation_steps is {steps}" in str(info.value)
        acc.close()
        exact(accelerator, model, opt).close()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
