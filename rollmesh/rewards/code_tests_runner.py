"""The test runner the ``code_tests`` reward runs inside a sandbox: ``python3 -I -S runner.py``
with ``solution.py`` beside it and a JSON job on stdin.

Standard library only, and imports nothing of rollmesh: it is copied into the sandbox as a file.
The job is ``{"nonce", "tests", "timeout_s"}``. ``tests`` is a list of statements (each one test,
typically ``assert f(1) == 2``) or a string of Python test code (each top-level ``def test_*`` is
one test, called after the code ran; without any, the code as a whole is one test). Before any of
the solution's code runs, the runner prints ``<nonce> total <n>``; then ``<nonce> pass <i>`` or
``<nonce> fail <i>`` as each test ends, on a copy of stdout the solution's prints do not reach
(they go to stderr). A test that runs past ``timeout_s`` is interrupted by SIGALRM and fails; a
solution that does not load fails every test. A killed run keeps the lines it printed, so the
reward can count the tests that passed before a hang.

Not a defence against a solution that reads the runner's frames for the nonce: the sandbox
bounds what such code can do, and it can at most lie about its own score.
"""

import ast
import json
import os
import signal
import sys


class TestTimedOutError(BaseException):  # not an Exception: a solution's ``except Exception`` cannot swallow it
    pass


def _alarm(signum, frame):
    raise TestTimedOutError()


def _run(code, namespace, timeout_s):
    """Whether ``code`` ran without raising within ``timeout_s``."""
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        code() if callable(code) else exec(code, namespace)
        return True
    except BaseException:  # an assertion, any error, SystemExit, the timeout: the test failed
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main():
    job = json.loads(sys.stdin.read())
    nonce, tests, timeout_s = job["nonce"], job["tests"], float(job["timeout_s"])
    out = os.dup(1)
    os.dup2(2, 1)  # the solution's prints go to stderr; the results to the saved stdout

    def report(line):
        os.write(out, f"{nonce} {line}\n".encode())

    if isinstance(tests, list):
        names = []
        compiled = [compile(statement, f"<test {i}>", "exec") for i, statement in enumerate(tests)]
    else:
        tree = ast.parse(tests)
        names = [node.name for node in tree.body
                 if isinstance(node, ast.FunctionDef) and node.name.startswith("test")]
        compiled = [compile(tree, "<tests>", "exec")]
    total = len(names) or len(compiled)
    report(f"total {total}")
    signal.signal(signal.SIGALRM, _alarm)
    sys.path.insert(0, os.getcwd())  # ``from solution import f`` works in the tests too
    namespace = {"__name__": "solution"}
    with open("solution.py", encoding="utf-8") as file:
        source = file.read()
    try:
        solution = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError):
        return
    if not _run(solution, namespace, timeout_s):
        return  # every test fails: the solution did not load
    if names:
        if not _run(compiled[0], namespace, timeout_s):
            return
        for index, name in enumerate(names):
            function = namespace.get(name)
            report(f"{'pass' if callable(function) and _run(function, namespace, timeout_s) else 'fail'} {index}")
        return
    for index, code in enumerate(compiled):
        report(f"{'pass' if _run(code, namespace, timeout_s) else 'fail'} {index}")


if __name__ == "__main__":
    main()
