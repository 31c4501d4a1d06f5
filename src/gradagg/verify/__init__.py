"""The contract checks, reported as observations in the case documents' form.

:func:`run_checks` runs every check of one contract against a function in this
process (the built-in one by default); :func:`run_checks_isolated` imports a
user's ``MODULE:FUNCTION`` in a child process, sends it the checks' arguments,
and judges its answers here. Both return
``{"observations": [{"check", "actual", "expected", "passed"}, ...], "passed": bool}``.

* :mod:`gradagg.verify.cases`: every check (the case documents' 13, ours, fresh twins);
* :mod:`gradagg.verify.run`: running them in this process, and the one judge;
* :mod:`gradagg.verify.isolate` and :mod:`gradagg.verify.child`: the child process.

Whatever a checked function does (raise, call ``sys.exit``, print, return an
object that claims to equal anything), only a plain result equal to the
expected one passes: results are turned into plain lists, numbers and strings
(:func:`plain`) before they are compared. In a child process it may also end
the process, hang, replace the checker's functions or write into its channels:
the checks it did not answer fail, and the expected values are never in the child.
"""

from gradagg.verify.cases import (
    MICROBATCH_MEAN_DOCUMENT,
    OWNER_SUM_DOCUMENT,
    SEED,
    Case,
    cases,
    fresh_cases,
    microbatch_mean_cases,
    owner_sum_cases,
)
from gradagg.verify.child import plain
from gradagg.verify.isolate import run_checks_isolated
from gradagg.verify.run import call, observations, run_checks, same

__all__ = [
    "MICROBATCH_MEAN_DOCUMENT", "OWNER_SUM_DOCUMENT", "SEED", "Case", "call", "cases", "fresh_cases",
    "microbatch_mean_cases", "observations", "owner_sum_cases", "plain", "run_checks", "run_checks_isolated", "same",
]
