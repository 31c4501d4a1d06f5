"""``gradagg parity``: local gloo worlds judge the examples and the broken fixture scripts right, in bounded time.

Every example of examples/parity runs on the default layouts (8; 4,4; 1,7 over a window of 8
microbatches with 95 valid tokens, 58 in the first half and 37 in the second). A right step matches
the float64 full batch to round-off; each mistake fails where its arithmetic says it must. The
fixture scripts of tests/parity break the step in one way each (raise, exit, abort, hang, skip a
collective, no all-reduce, NaN, zero for absent, a DTensor shard dropped on one rank) or make the
script unusable (exit 2). The FSDP2 examples also run where the counts differ and where rank 0 has
none (1,7 and 0,8). One world per layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradagg import cli
from gradagg.errors import GradaggError

torch = pytest.importorskip("torch")

from gradagg.parity import ParityReport, ScriptError, check_parity  # noqa: E402
from gradagg.parity.report import summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "parity"
FIXTURES = Path(__file__).resolve().parent / "scripts"
DEFAULT_LAYOUTS = [[8], [4, 4], [1, 7]]
# float64 round-off: the step and the full batch add the same terms in different orders (measured
# ~5e-16); 1e-13 leaves a margin of 200 and is 12 orders of magnitude below any mistake's error.
ROUND_OFF_64 = 1e-13
# Short limits for the failure worlds, so that a test waits seconds, not a minute.
FAST = {"timeout_s": 30.0, "collective_timeout_s": 3.0}

# example -> passed on each default layout (8; 4,4; 1,7)
VERDICTS = {
    "token_mean_by_hand": (True, True, True),
    "mistake_mean_of_microbatch_means": (False, False, False),  # unequal token counts, even in one process
    "mistake_mean_of_rank_means": (True, False, False),  # one rank is one mean; 58 vs 37 tokens on 4,4
    "mistake_no_division": (False, False, False),
    "mistake_ddp_average_and_global_tokens": (True, False, False),  # 1/W on 2 ranks
}
if (EXAMPLES / "token_mean_gradagg.py").exists():
    VERDICTS["token_mean_gradagg"] = (True, True, True)


@pytest.fixture(scope="module")
def reports() -> dict[str, ParityReport]:
    """Each example checked once on the default layouts (one world per layout), shared by the tests below."""
    return {name: check_parity(str(EXAMPLES / f"{name}.py")) for name in VERDICTS}


def _fixture(name: str) -> str:
    return str(FIXTURES / f"{name}.py")


# --- the examples ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_each_example_passes_or_fails_on_the_layouts_its_arithmetic_says(
        name: str, reports: dict[str, ParityReport]) -> None:
    """Right steps pass every default layout at float64 round-off; each mistake fails where it must."""
    report = reports[name]
    assert [o["layout"] for o in report.observations] == DEFAULT_LAYOUTS
    assert tuple(o["passed"] for o in report.observations) == VERDICTS[name]
    assert report.passed is all(VERDICTS[name])
    assert report.rtol == 1e-9 and report.dtype == "float64" and report.window == 8
    for o in report.observations:
        if o["passed"]:
            assert 0.0 <= o["actual"] <= ROUND_OFF_64, o
        else:
            assert o["actual"] > 1e-2, o  # a mistake misses by percents, not by round-off


def test_no_division_is_the_window_token_count_times_the_truth(reports: dict[str, ParityReport]) -> None:
    """Sums never divided: grads = 95 x the truth (95 valid tokens) on every parameter, every layout."""
    for o in reports["mistake_no_division"].observations:
        assert o["ratio"] == pytest.approx(95.0, rel=1e-12)
        assert o["actual"] == pytest.approx(94.0, rel=1e-12)  # ||95 t - t|| / ||t||
        assert o["diagnosis"].startswith("grads are 95x the truth on every parameter: a divisor 95 times too small")


def test_ddp_average_on_a_global_divisor_is_half_the_truth_on_two_ranks(reports: dict[str, ParityReport]) -> None:
    """DDP divides by W = 2 on top of the global token count: 0.5x, and the world size is named."""
    _, even, uneven = reports["mistake_ddp_average_and_global_tokens"].observations
    for o in (even, uneven):
        assert o["ratio"] == pytest.approx(0.5, rel=1e-12)
        assert "grads are 0.5x the truth on every parameter: a divisor twice too large" in o["diagnosis"]
        assert "the world size, 2" in o["diagnosis"]


def test_weighting_mistakes_have_no_single_factor(reports: dict[str, ParityReport]) -> None:
    """A mean of means reweights microbatches: not one factor, and the diagnosis says so."""
    for name in ("mistake_mean_of_microbatch_means", "mistake_mean_of_rank_means"):
        for o in reports[name].observations:
            if not o["passed"]:
                assert o["ratio"] is None and o["diagnosis"].startswith("no single factor"), o


def test_observations_have_the_verify_form_and_name_the_worst_parameter(reports: dict[str, ParityReport]) -> None:
    """``{"observations": [{"check", "actual", "expected", "passed", ...}], "passed"}``, strict JSON."""
    report = reports["mistake_mean_of_rank_means"]
    data = json.loads(json.dumps(report.json, allow_nan=False))
    assert list(data) == ["observations", "passed"] and data["passed"] is False
    names = {"0.weight", "2.weight", "2.bias"}  # Embedding, Tanh, Linear
    for o in data["observations"]:
        assert list(o)[:4] == ["check", "actual", "expected", "passed"]
        assert o["expected"] == "<= 1e-09" and o["check"].startswith(f"layout {','.join(map(str, o['layout']))}:")
        assert o["parameter"] in names and o["rank"] in range(len(o["layout"]))


def test_summary_names_the_ratio_and_the_worst_parameter(reports: dict[str, ParityReport]) -> None:
    text = summary(reports["mistake_ddp_average_and_global_tokens"])
    lines = text.splitlines()
    assert lines[0].endswith("8 microbatches, float64, rtol 1e-09")
    assert lines[1].split()[:3] == ["layout", "8", "pass"]
    assert lines[2].split()[:3] == ["layout", "4,4", "FAIL"] and "max relative error 0.5" in lines[2]
    assert "grads are 0.5x the truth on every parameter: a divisor twice too large" in lines[3]
    assert lines[-1].startswith("1 of 3 layouts passed")


# --- the command line --------------------------------------------------------------------


def test_command_prints_only_json_on_stdout_despite_prints_and_exits_0() -> None:
    """A real ``gradagg parity`` process on a chatty but right script: exit 0, stdout is the JSON alone."""
    proc = subprocess.run([sys.executable, "-m", "gradagg", "parity", _fixture("prints"), "--layouts", "4", "1,3"],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["passed"] is True and [o["layout"] for o in data["observations"]] == [[4], [1, 3]]
    assert "importing prints.py" in proc.stderr and "step with 3 microbatches" in proc.stderr


def test_command_exits_1_on_a_mistake_and_draws_the_summary_on_a_terminal(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal:
        def __init__(self) -> None:
            self.text = ""

        def write(self, s: str) -> int:
            self.text += s
            return len(s)

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    status = cli.main(["parity", str(EXAMPLES / "mistake_no_division.py"), "--layouts", "8"])
    assert status == 1
    assert json.loads(capsys.readouterr().out)["passed"] is False
    assert "FAIL" in terminal.text and "grads are 95x the truth on every parameter" in terminal.text


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(["parity", *argv])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "", "nothing half-written on stdout"
    assert err.startswith("gradagg: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(("argv", "message"), [
    ([_fixture("no_step")], "defines no step()"),
    ([_fixture("right"), "--layouts", "1,2"], "the counts sum to 3, but microbatches() returned 4"),
    ([_fixture("right"), "--layouts", "4", "1,x"], "layout '1,x': expected microbatch counts per rank"),
    ([_fixture("right"), "--layouts", "1,-1,4"], "cannot run -1 microbatches"),
    ([_fixture("right"), "--layouts", ",".join(["0"] * 8 + ["4"])], "9 ranks; at most 8 local processes"),
    ([_fixture("right"), "--rtol", "2"], "rtol must be a number from 0"),
    ([_fixture("right"), "--rtol", "abc"], "invalid float value"),
    ([_fixture("unseeded_model")], "build_model() is not deterministic: parameter 'weight' differs between two"),
    ([str(FIXTURES / "missing.py")], "missing.py: no such file"),
    ([str(FIXTURES)], "is a folder, not a script"),
])
def test_unusable_script_or_options_exit_2_with_one_line(
        capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert message in _usage_error(capsys, *argv)


def test_unreadable_script_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A syntax error names its line; bytes that are not UTF-8 and an import that raises are one line too."""
    broken = tmp_path / "broken.py"
    broken.write_text("def build_model(:\n")
    assert "broken.py line 1: SyntaxError" in _usage_error(capsys, str(broken))
    binary = tmp_path / "binary.py"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert "binary.py" in _usage_error(capsys, str(binary))
    raising = tmp_path / "raising.py"
    raising.write_text("raise RuntimeError('no data here')\n")
    assert "importing it raised RuntimeError: no data here" in _usage_error(capsys, str(raising))
    if os.geteuid() != 0:  # root reads any file: no permission error to provoke
        locked = tmp_path / "locked.py"
        locked.write_text("x = 1\n")
        locked.chmod(0)
        assert "cannot read it" in _usage_error(capsys, str(locked))


def test_a_model_that_differs_between_processes_is_unusable() -> None:
    """Seeded by the process id: equal within the checking process, different on the rank: exit 2's error."""
    with pytest.raises(ScriptError, match=r"not deterministic: parameter 'weight' differs on rank 0 of layout 4"):
        check_parity(_fixture("model_per_process"), [(4,)], **FAST)


# --- a step that fails on one rank: a failed observation, in bounded time ---------------------


@pytest.mark.parametrize(("name", "first"), [
    ("raises_on_rank1", "rank 1: step() raised ZeroDivisionError: boom on rank 1 (at raises_on_rank1.py line 11)"),
    ("exits_on_rank1", "rank 1: step() raised sys.exit(3)"),
    ("hard_exits_on_rank1", "rank 1: exited with code 7 without returning a result"),
    ("aborts_on_rank1", "rank 1: died of SIGABRT without returning a result"),  # not "did not finish": no one waited
])
def test_a_rank_that_fails_fails_its_layout_fast_and_is_named_first(name: str, first: str) -> None:
    """Rank 1 stops; rank 0, waiting in an all-reduce, loses its peer at once instead of timing out."""
    (o,) = check_parity(_fixture(name), [(2, 2)], **FAST).observations
    assert o["passed"] is False and o["rank"] == 1
    assert o["actual"].startswith(first) and "rank 0: step() raised RuntimeError" in o["actual"]
    assert "Timed out" not in o["actual"] and "deadline" not in o["actual"], o["actual"]  # its connection closed
    assert o["diagnosis"].endswith("then rank 0, waiting for it")


def test_a_prepare_that_raises_is_named_as_prepare() -> None:
    """The phase in the message is the function that raised: prepare(), which runs after build_model()."""
    (o,) = check_parity(_fixture("prepare_raises"), [(4,)], **FAST).observations
    assert o["passed"] is False
    assert o["actual"].startswith("rank 0: prepare() raised AssertionError: Please init the 2D mesh"), o["actual"]


def test_a_rank_left_alone_in_a_collective_fails_its_layout_and_the_cause_is_guessed() -> None:
    """Rank 0 returns without the all-reduces; rank 1 loses its peer: failed, with the likely cause named."""
    (o,) = check_parity(_fixture("skips_collective_on_rank0"), [(2, 2)], **FAST).observations
    assert o["passed"] is False and o["rank"] == 1
    assert "rank 0 returned from step() while rank 1 waited for it in a collective" in o["diagnosis"]


def test_a_rank_that_hangs_in_python_is_killed_at_the_deadline() -> None:
    """Rank 1 spins forever: rank 0 times out in its collective (2 s), rank 1 is killed at the deadline (4 s).

    Rank 2 waits for rank 1 on a group with torch's 30-minute default timeout: it fails only when rank 1
    is killed, after the deadline, and its result is still read.
    """
    (o,) = check_parity(_fixture("hangs_on_rank1"), [(1, 1, 2)], timeout_s=4.0,
                        collective_timeout_s=2.0).observations
    assert o["passed"] is False
    assert o["actual"].startswith("rank 1: did not finish within the deadline (4 s) and was killed")
    assert "rank 0: step() raised RuntimeError" in o["actual"]
    assert "rank 2: step() raised RuntimeError" in o["actual"], o["actual"]  # not "exited ... without a result"
    assert o["diagnosis"].endswith("then rank 0, 2, waiting for it")


# --- what the comparison tells apart ------------------------------------------------------------


def test_unsynchronised_ranks_pass_alone_and_disagree_together() -> None:
    """No all-reduce is right in one process: only a layout with 2 ranks on different data exposes it."""
    single, even, uneven = check_parity(_fixture("no_all_reduce"), **FAST).observations
    assert single["passed"] is True
    for o in (even, uneven):
        assert o["passed"] is False and o["diagnosis"].startswith("ranks disagree:")


def test_nan_from_a_rank_without_microbatches_fails_whatever_the_tolerance() -> None:
    (o,) = check_parity(_fixture("nan_on_empty_rank"), [(0, 4)], rtol=0.99, **FAST).observations
    assert o["passed"] is False and o["actual"] == "nan"
    assert "non-finite" in o["diagnosis"] and "rank 0 ran no microbatch" in o["diagnosis"]


def test_a_zero_gradient_where_the_truth_has_none_fails_and_none_passes() -> None:
    """Absent is not zero: an unused layer written as zeros fails; left None, the same step passes."""
    zeros = check_parity(_fixture("zero_for_unused"), [(4,), (1, 3)], **FAST)
    assert not any(o["passed"] for o in zeros.observations)
    assert all("'unused.weight' has a gradient (all zeros) where the full batch has none" in o["actual"]
               for o in zeros.observations)
    assert check_parity(_fixture("keeps_unused_none"), [(4,), (1, 3)], **FAST).passed


def test_float32_default_tolerance_passes_round_off_and_fails_the_mistake() -> None:
    """float32: rtol defaults to 1e-3; the right step's error is ~3e-7, the mean of rank means 0.26 on 4,4."""
    right = check_parity(_fixture("float32_by_hand"), [(8,), (4, 4)], **FAST)
    assert right.passed and right.rtol == 1e-3 and right.dtype == "float32"
    assert max(o["actual"] for o in right.observations) < 1e-5
    wrong = check_parity(_fixture("float32_mean_of_rank_means"), [(8,), (4, 4)], **FAST)
    assert [o["passed"] for o in wrong.observations] == [True, False]


def test_explicit_rtol_is_the_bar() -> None:
    """The DDP mistake misses by exactly 0.5 on 2 ranks: --rtol 0.6 lets it pass, the default does not."""
    assert check_parity(str(EXAMPLES / "mistake_ddp_average_and_global_tokens.py"), [(4, 4)], rtol=0.6).passed


def test_fsdp2_dtensor_gradients_are_assembled_and_compared() -> None:
    """fully_shard leaves DTensor shards in .grad; parity assembles them from every rank and finds them right."""
    pytest.importorskip("torch.distributed.fsdp")
    report = check_parity(_fixture("fsdp2_token_mean"), [(8,), (4, 4)], **FAST)
    assert report.passed, report.observations
    assert all(o["actual"] <= ROUND_OFF_64 for o in report.observations)


# --- FSDP2 with uneven counts -------------------------------------------------------------------

FSDP2_LAYOUTS = [(8,), (4, 4), (1, 7), (0, 8)]
# example -> passed on each of 8; 4,4; 1,7; 0,8
FSDP2_VERDICTS = {
    "fsdp2_token_mean_gradagg": (True, True, True, True),
    "mistake_fsdp2_sync_last_microbatch": (True, True, False, False),  # right only when the counts are equal
}


def test_fsdp2_examples_on_uneven_counts_and_a_rank_with_none() -> None:
    """gradagg's FSDP2 step matches the full batch everywhere; FSDP2's own no_sync recipe fails where counts differ.

    1,7: rank 0's only backward reduce-scatters while rank 1's first one does not: their collectives no
    longer pair up and both ranks time out (3 s) inside step(). 0,8: rank 0 runs no backward, returns at
    once, and rank 1 loses it in its first all-gather. Both fail inside step(), never at the deadline.
    """
    pytest.importorskip("torch.distributed.fsdp")
    for name, verdicts in FSDP2_VERDICTS.items():
        report = check_parity(str(EXAMPLES / f"{name}.py"), FSDP2_LAYOUTS, **FAST)
        assert tuple(o["passed"] for o in report.observations) == verdicts, report.observations
        assert all(o["actual"] <= ROUND_OFF_64 for o in report.observations if o["passed"])
        assert not any("deadline" in str(o["actual"]) for o in report.observations), report.observations
    _, _, uneven, empty = report.observations
    assert uneven["diagnosis"].startswith("every rank failed inside a collective"), uneven
    assert "different numbers of microbatches" in uneven["diagnosis"]
    assert "rank 0 returned from step() while rank 1 waited for it in a collective" in empty["diagnosis"], empty


def test_a_dtensor_gradient_left_none_on_one_rank_is_named_not_a_lost_peer() -> None:
    """Rank 0 drops its shard of '0.weight', rank 1 keeps its own: the missing gradient is what fails the layout.

    The shards are put together in the checking process, so no gather on rank 1 waits for one that
    rank 0 never sends (which read as a lost peer, or a gloo abort read as a hang).
    """
    pytest.importorskip("torch.distributed.fsdp")
    (o,) = check_parity(_fixture("fsdp2_none_on_rank0"), [(4, 4)], **FAST).observations
    assert o["passed"] is False and o["rank"] == 0 and o["parameter"] == "0.weight", o
    assert o["actual"].startswith("rank 0: '0.weight' has no gradient; the full batch's has norm"), o


def test_python_function_raises_for_a_layout_that_does_not_sum() -> None:
    with pytest.raises(GradaggError, match=r"layout 2,1: the counts sum to 3, but microbatches\(\) returned 4"):
        check_parity(_fixture("right"), [(2, 1)])




def test_a_float64_model_whose_loss_casts_to_float32_is_judged_at_float32_round_off() -> None:
    """The tolerance is what the step computes in: a float64 model whose loss casts the logits to float32 passes
    by default (its error is float32 round-off, ~1e-7, far above float64's 1e-9); its mean-of-means twin still
    fails on every layout, blamed on the weighting; at an explicit float64 rtol the right one fails as round-off."""
    right = check_parity(_fixture("float32_loss_cast"), [(8,), (4, 4), (1, 7)], **FAST)
    assert right.passed and right.rtol == 1e-3 and right.dtype == "float32", right.observations
    assert max(o["actual"] for o in right.observations) > 1e-9  # the bar float64 alone would have set
    wrong = check_parity(_fixture("float32_loss_cast_mean_of_means"), [(8,), (4, 4), (1, 7)], **FAST)
    assert not any(o["passed"] for o in wrong.observations), wrong.observations
    for o in wrong.observations:
        assert o["diagnosis"].startswith("no single factor"), o
    strict = check_parity(_fixture("float32_loss_cast"), [(4, 4)], rtol=1e-9, **FAST)
    (o,) = strict.observations
    assert not o["passed"] and o["ratio"] is None, o
    assert o["diagnosis"].startswith("round-off, not a weighting mistake: "), o
    assert "float32" in o["diagnosis"] and "mean of" not in o["diagnosis"], o


def test_a_mean_loss_given_a_weight_is_named_first() -> None:
    """The README's warning, named in the diagnosis: a mean loss with weight=n is divided twice."""
    report = check_parity(_fixture("mean_loss_with_weight"), [(4, 4)], **FAST)
    (o,) = report.observations
    assert not o["passed"] and o["ratio"] is None, o
    assert "(a mean loss given weight=n, divided twice" in o["diagnosis"], o


# --- FSDP1 ----------------------------------------------------------------------------------------


def test_fsdp1_pieces_are_put_together_and_compared() -> None:
    """FSDP1 with use_orig_params=True leaves each rank a 1-d piece of each gradient (empty on some ranks; .grad
    None there): parity concatenates the ranks' pieces and finds gradagg's step right on uneven counts and a rank
    with none; FSDP1's own recipe (a mean of the ranks' token means) fails on the uneven split, by its weighting."""
    pytest.importorskip("torch.distributed.fsdp")
    layouts = [(8,), (4, 4), (1, 7), (0, 8)]
    report = check_parity(_fixture("fsdp1_token_mean"), layouts, **FAST)
    assert report.passed, report.observations
    assert all(o["actual"] <= ROUND_OFF_64 for o in report.observations)
    wrong = check_parity(_fixture("fsdp1_mean_of_rank_means"), [(8,), (4, 4)], **FAST)
    assert [o["passed"] for o in wrong.observations] == [True, False], wrong.observations
    assert 0.01 < wrong.observations[1]["actual"] < 1, wrong.observations


def test_fsdp1_flat_parameters_are_named_not_misread() -> None:
    """use_orig_params=False: every parameter fails on two ranks with one sentence naming FSDP1's flat parameters
    and use_orig_params=True, not a misleading "no parameter" or shape error."""
    pytest.importorskip("torch.distributed.fsdp")
    report = check_parity(_fixture("fsdp1_flat_params"), [(4, 4)], **FAST)
    (obs,) = report.observations
    assert not obs["passed"], obs
    assert "use_orig_params=True" in obs["diagnosis"] and "flat parameter" in obs["diagnosis"], obs
