"""Every code block of README.md and docs/ runs as shown, or says why not (the rules: tests/docs_blocks.py)."""

from __future__ import annotations

import ast
import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_blocks import (
    FRAGMENT,
    LANGUAGES,
    ROOT,
    Block,
    all_blocks,
    blocks,
    console_steps,
    documents,
    expected_by_comment,
    gradagg_imports,
)

BLOCKS = all_blocks()
CHECKER = doctest.OutputChecker()
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _env() -> dict[str, str]:
    """This Python's scripts (``gradagg``, ``torchrun``) first on PATH; this checkout's gradagg first to import."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    pythonpath = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "GLOO_SOCKET_IFNAME": "lo"}


def _following(block: Block) -> Block | None:
    """The block after this one in its file, if any."""
    same = blocks(block.path)
    i = next(k for k, b in enumerate(same) if b.line == block.line)
    return same[i + 1] if i + 1 < len(same) else None


def _of(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind]


def _ids(found: list[Block]) -> list[str]:
    return [b.where for b in found]


def _scripts() -> list[Block]:
    """The script blocks, one per distinct text with the same output block (a page may repeat the README's)."""
    seen: dict[tuple[str, str | None], Block] = {}
    for b in _of("script"):
        after = _following(b)
        seen.setdefault((b.text, after.text if after is not None and after.prints else None), b)
    return list(seen.values())


def test_the_documents_have_blocks_and_every_one_is_of_a_known_kind() -> None:
    """No block goes unchecked: each is one of the kinds that the tests below run or check."""
    assert len(documents()) > 10 and len(BLOCKS) > 30
    unknown = [b.where for b in BLOCKS if b.lang not in LANGUAGES or b.kind == "unknown"]
    assert not unknown, f"blocks of no known kind (see tests/docs_blocks.py): {unknown}"


@pytest.mark.parametrize("block", _scripts(), ids=_ids(_scripts()))
def test_script_blocks_run_when_pasted_into_a_file(block: Block, tmp_path: Path) -> None:
    """Saved as a file and run with ``python`` outside the repository: exit 0, and print what the page says (a
    block repeated with the same text and output elsewhere is run once)."""
    after = _following(block)
    expected = after.text if after is not None and after.prints else expected_by_comment(block.text)
    (tmp_path / "pasted.py").write_text(block.text)
    proc = subprocess.run([sys.executable, "pasted.py"], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env=_env())
    assert proc.returncode == 0, f"{block.where}: {proc.stderr[-3000:]}"
    if expected is not None:
        assert proc.stdout == expected, f"{block.where}: printed {proc.stdout!r}, the page says {expected!r}"


@pytest.mark.parametrize("block", _of("doctest"), ids=_ids(_of("doctest")))
def test_doctest_blocks(block: Block) -> None:
    test = doctest.DocTestParser().get_doctest(block.text, {}, block.where, str(block.path), block.line)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    result = runner.run(test, clear_globs=True)
    assert result.attempted > 0 and result.failed == 0, f"{block.where}: {result.failed} of {result.attempted}"


@pytest.mark.parametrize("block", _of("console"), ids=_ids(_of("console")))
def test_console_blocks_print_what_they_show(block: Block, tmp_path: Path) -> None:
    """Each ``$`` command prints the lines shown under it (``...``: anything). It runs in a folder of its own that
    holds the repository's ``examples/`` (a link), so what a command writes never lands in the repository."""
    steps = console_steps(block.text)
    assert steps, f"{block.where}: a console block with no '$ ' command"
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for cmd, expected in steps:
        proc = subprocess.run(["bash", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=300, cwd=tmp_path, env=_env())
        assert CHECKER.check_output(expected, proc.stdout, FLAGS), (
            f"{block.where}: $ {cmd}\nexpected:\n{expected}\ngot (exit {proc.returncode}):\n{proc.stdout[-3000:]}")


@pytest.mark.parametrize("block", _of("fragment"), ids=_ids(_of("fragment")))
def test_fragments_say_what_they_need_compile_and_import(block: Block) -> None:
    """A fragment cannot run alone: it says so on its first line, compiles, and what it imports of gradagg exists;
    an example or test it names as running it exists."""
    reason = block.text.splitlines()[0][len(FRAGMENT):].strip()
    assert len(reason) >= 10, f"{block.where}: a fragment must say what it needs ('{FRAGMENT} ...')"
    compile(block.text, block.where, "exec")
    for word in reason.replace(",", " ").replace(";", " ").replace(")", " ").split():
        if word.startswith(("examples/", "tests/", "bench/")):
            assert (ROOT / word.split("::")[0]).exists(), f"{block.where}: names {word}, which does not exist"
    _shared_helpers_called_as_defined(block)
    imports = gradagg_imports(block.text)
    try:
        exec(compile(imports, block.where, "exec"), {})  # in this process: each module is imported once for all blocks
    except ModuleNotFoundError as exc:  # a framework this install lacks (gradagg's own modules must import)
        if (exc.name or "gradagg").split(".")[0] == "gradagg":
            raise
        pytest.skip(f"{block.where} imports a module that needs {exc.name}, which is not installed")


def _shared_helpers_called_as_defined(block: Block) -> None:
    """A fragment cannot run, so nothing else checks how it calls the helpers the README defines: ``loss_sum(model,
    ids)`` takes the model (a name: the model, ``self`` in a LightningModule), never its output (a call)."""
    for node in ast.walk(ast.parse(block.text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("loss_sum", "n_tokens"):
            want = 2 if node.func.id == "loss_sum" else 1
            assert len(node.args) == want, f"{block.where}: {ast.unparse(node)} takes {want} argument(s)"
            if node.func.id == "loss_sum":
                model = node.args[0]
                assert not isinstance(model, ast.Call), (
                    f"{block.where}: {ast.unparse(node)} passes the model's output; loss_sum takes the model")


@pytest.mark.parametrize("block", _of("not run"), ids=_ids(_of("not run")))
def test_blocks_not_run_say_why(block: Block) -> None:
    assert block.marker is not None and len(block.marker[1].strip()) >= 10, f"{block.where}: give the reason"
    assert block.lang != "python", f"{block.where}: a python block is run, or is a '{FRAGMENT}'"


@pytest.mark.parametrize("block", _of("run by"), ids=_ids(_of("run by")))
def test_blocks_run_by_a_test_name_one_that_exists(block: Block) -> None:
    """``<!-- run by: tests/FILE.py::test_name -->``: that file defines that test."""
    assert block.marker is not None
    for ref in block.marker[1].replace(",", " ").split():
        if not ref.startswith("tests/"):
            continue
        file, _, name = ref.partition("::")
        assert (ROOT / file).is_file(), f"{block.where}: {file} does not exist"
        assert not name or f"def {name.split('[')[0]}(" in (ROOT / file).read_text(), f"{block.where}: no {ref}"
        break
    else:
        pytest.fail(f"{block.where}: 'run by:' names no tests/FILE.py::test_name")


def test_prints_blocks_follow_the_script_they_show() -> None:
    """An output block belongs to the script right before it (whose test compares them)."""
    for block in _of("prints"):
        same = blocks(block.path)
        i = next(k for k, b in enumerate(same) if b.line == block.line)
        assert i > 0 and same[i - 1].kind == "script", f"{block.where}: a 'prints' block after no script block"


def test_the_readmes_relative_links_point_to_files_that_exist() -> None:
    """mkdocs build --strict checks the site's links; the README is outside it, so its links are checked here."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    assert len(links) > 10, links
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
