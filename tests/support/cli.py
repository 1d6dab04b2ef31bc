"""The command line as the CLI tests drive it: ``run`` (main with argv, exit code and output); the ``no_gpu``
fixture lives in tests/conftest.py."""

from __future__ import annotations

import pytest

from cudnn_moe.__main__ import main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr); argparse's exits become codes."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err
