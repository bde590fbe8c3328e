"""The device calls' command lines parse here, before a lent GPU's minutes are spent on them.

Each ``benchmarks/device/call*.sh`` is checked by ``bash -n``; every ``python3 -m MODULE ...``
in it is expanded by bash after sourcing ``lib.sh`` (its ``$E``, ``$L``) and given to the
real parser of that module; the ``edmm serve`` command a bench would start (``--edmm-args``,
``bench live``'s server options) is given to ``edmm serve``'s parser. A typo in a flag fails
here instead of on the device.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICE = ROOT / "benchmarks" / "device"
CALLS = sorted(DEVICE.glob("call*.sh"))


def commands(script: Path) -> list[list[str]]:
    """Every ``python3 -m ...`` command of ``script`` as bash expands it (lib.sh sourced,
    ``$R`` a folder), without what follows it on its line (redirections, pipes, the ``)`` that
    closes a command substitution)."""
    text = re.sub(r"\\\n\s*", " ", script.read_text())  # continuation lines joined
    found = []
    for line in text.splitlines():
        m = re.search(r"python3 (-m \S+.*?)(?:\s+2>&1|\s+\||\s+>|\)$|$)", line)
        if m and not line.lstrip().startswith("#"):
            found.append(m.group(1))
    out = []
    for cmd in found:
        shell = (f"source {DEVICE / 'lib.sh'}; R=/tmp/r; eval set -- {shlex.quote(cmd)}; "
                 "printf '%s\\0' \"$@\"")
        done = subprocess.run(["bash", "-c", shell], cwd=ROOT, capture_output=True, check=True)
        out.append(done.stdout.decode().split("\0")[:-1])
    return out


def _serve(argv: list[str]) -> None:
    """``edmm serve``'s options (after ``-m edmm serve``), the port placeholder filled."""
    from edmm.server.cli import build_parser

    build_parser().parse_args([a.replace("{port}", "8000") for a in argv])


def _edmm(argv: list[str]) -> None:
    from edmm.bench.peers import edmm_spec
    from edmm.cli import build_parser

    args = build_parser().parse_args(argv)
    if args.command != "bench":
        return
    if getattr(args, "edmm_args", None) is not None:  # the server load/single start
        _serve(list(edmm_spec(shlex.split(args.edmm_args)).launch[4:]))
    if args.bench == "live":
        from edmm.bench.live import LiveBenchConfig, server_command

        cfg = LiveBenchConfig(model=args.model, device=args.device, contexts=args.contexts,
                              result_tokens=args.result_tokens,
                              server_args=tuple(args.server_arg))
        _serve(server_command(cfg)[4:])


def _parse(argv: list[str]) -> None:
    module, rest = argv[1], argv[2:]
    if module == "edmm":
        _edmm(rest)
    elif module == "benchmarks.scripts.fleet_http_peers":
        from benchmarks.scripts.fleet_http_peers import parse_args

        parse_args(rest)
    elif module == "benchmarks.scripts.prefill_step_profile":
        from benchmarks.scripts.prefill_step_profile import build_parser as profile_parser

        profile_parser().parse_args(rest)
    elif module == "benchmarks.scripts.grammar_masks":
        from benchmarks.scripts.grammar_masks import build_parser as masks_parser

        masks_parser().parse_args(rest)
    elif module == "benchmarks.scripts.call_tokens":
        from benchmarks.scripts.call_tokens import build_parser as tokens_parser

        tokens_parser().parse_args(rest)
    elif module == "benchmarks.kernels.attention":
        from benchmarks.kernels.attention import build_parser

        build_parser().parse_args(rest)
    elif module not in ("pytest", "pip"):  # not ours: their own options
        raise AssertionError(f"a device call runs {module}: teach this test its parser")


@pytest.mark.parametrize("script", CALLS, ids=lambda p: p.name)
def test_device_call_parses(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)
    for argv in commands(script):
        try:
            _parse(argv)
        except SystemExit as e:  # argparse's error exit
            raise AssertionError(f"{script.name}: {shlex.join(argv)}") from e


def test_a_bad_flag_is_caught(tmp_path: Path) -> None:
    bad = tmp_path / "call9.sh"
    bad.write_text('timeout 9 python3 -m edmm bench load $L --edmm-args "$E --no-such-flag" '
                   "--out $R/x 2>&1 | tail -1\n")
    (argv,) = commands(bad)
    assert argv[:4] == ["-m", "edmm", "bench", "load"] and "--prompt-tokens" in argv
    with pytest.raises(SystemExit):
        _parse(argv)
    with pytest.raises(SystemExit):
        _parse(["-m", "edmm", "bench", "live", "--server-arg=--no-such-flag"])
