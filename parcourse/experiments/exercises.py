"""What every exercise check shares: calling a learner's function (`ask`) or running a
learner's rank function (`run_exercise`), and saying in one line why there is no answer
when there is none. A check prints, it does not raise: a wrong answer should read as a
hint, not as a traceback."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

from parcourse.launch import LaunchError, Pool, RankError, RankTimeout, Run

NOT_WRITTEN = "Not written yet: fill in the function above, then run this cell again."


def ask(
    fn: Callable[..., Any],
    *args: Any,
    where: str = "",
    hint: Callable[[Exception], str | None] | None = None,
) -> tuple[bool, Any]:
    """Call the learner's `fn(*args)`: (True, its answer), or (False, None) after printing
    one line: not written yet, or what it raised (`where`: with which inputs, e.g.
    "with shape (5,), "), and the check's `hint` for that error when it has one."""
    try:
        return True, fn(*args)
    except NotImplementedError:
        print(NOT_WRITTEN)
    except Exception as e:  # noqa: BLE001 - the learner's code: say what, not a traceback
        first = str(e).splitlines()[0] if str(e) else ""
        said = hint(e) if hint is not None else None
        print(
            f"Not yet: {where}your function raised {type(e).__name__}: {first}"
            + (f". Hint: {said}" if said else "")
        )
    return False, None


def whole_numbers(answer: Any, count: int | None = None) -> list[int] | None:
    """A learner's answer as whole numbers however it is spelt (a list or a tuple of
    Python's, numpy's or torch's integers), `count` of them if given; None when it is not
    that (a float, a string, a dict, no answer)."""
    if isinstance(answer, Mapping):  # iterating a dict gives its keys, never the answer
        return None
    try:
        numbers = [operator.index(x) for x in answer]
    except TypeError:
        return None
    return numbers if count is None or len(numbers) == count else None


def run_exercise(
    pool: Pool, fn: Callable[..., Any], *args: Any, timeout: float = 30.0, died: str = ""
) -> Run | None:
    """Run a learner's rank function for an exercise check.

    Returns the run, or None after printing one line that says why there is
    none: the function is still a stub, a rank raised (which rank, what), or
    the ranks were still waiting at `timeout` (a message nobody sends, a
    collective not every rank calls). A check prints, it does not raise: a
    wrong answer should read as a hint, not as a traceback. `died`: a hint for a rank
    that died, or whose backend raised (what its own abort text will not say).
    """
    try:
        return pool.run(fn, *args, timeout=timeout)
    except RankError as e:
        if e.exc_type == "NotImplementedError":
            print(NOT_WRITTEN)
        else:  # a backend's error (gloo's: RuntimeError) may want the hint; the learner's not
            print(
                f"Not yet: {_first_sentence(str(e))}{died if e.exc_type == 'RuntimeError' else ''}"
            )
        return None
    except RankTimeout as e:
        print(
            f"Not yet: ranks {', '.join(map(str, e.running))} were still waiting after "
            f"{timeout:g} s. Hint: every send needs a matching receive on the other rank, "
            "and every rank must call each collective."
        )
        return None
    except LaunchError as e:  # a rank died, or the function or its result cannot be sent
        print(f"Not yet: {_first_sentence(str(e))}{died}")
        return None


def _first_sentence(said: str) -> str:
    """A launcher's error, to its first line and without the other ranks' echoes of it
    (a backend's abort repeats itself on every rank)."""
    return said.splitlines()[0].split("; other ranks:")[0] if said else said
