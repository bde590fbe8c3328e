"""``edmm serve`` as ``vllm serve``: vLLM's command line, one-line errors (exit 2), the start-up
summary, API keys, and a graceful SIGTERM drain that leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from edmm.server.cli import build_parser, config_from_args, main

KEY = "sk-serve-test"


def test_a_vllm_command_line_maps_to_the_config(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        str(tmp_path), "--api-key", KEY, "--max-model-len", "32k",
        "--gpu-memory-utilization", "0.8", "--enable-auto-tool-choice", "--tool-call-parser",
        "hermes", "--served-model-name", "qwen", "--dtype", "bfloat16", "--seed", "3",
        "--host", "0.0.0.0", "--port", "9001", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "512", "--enable-prefix-caching",
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
        "--tensor-parallel-size", "1", "--load-format", "dummy", "--kv-cache-dtype", "auto"])
    config = config_from_args(args)
    assert (config.model, config.host, config.port, config.model_name) == (
        str(tmp_path), "0.0.0.0", 9001, "qwen")
    assert config.api_keys == (KEY,)
    assert config.engine == {"max_model_len": 32000, "max_num_seqs": 4,
                             "max_num_batched_tokens": 512, "dtype": "bfloat16",
                             "gpu_memory_utilization": 0.8, "seed": 3, "load_format": "dummy"}
    assert args.enable_prefix_caching is True and args.disable_uvicorn_access_log
    # without --served-model-name: the folder's name, and MODEL as given (vLLM's name)
    plain = config_from_args(build_parser().parse_args([str(tmp_path)]))
    assert plain.model_name == tmp_path.name and plain.model_aliases == (str(tmp_path),)


@pytest.mark.parametrize(("flag", "stored"), [("fp8", "fp8"), ("fp8_e4m3", "fp8"),
                                               ("bfloat16", "bf16"), ("bf16", "bf16")])
def test_kv_cache_dtype_takes_vllm_names(flag: str, stored: str) -> None:
    config = config_from_args(build_parser().parse_args(["--kv-cache-dtype", flag]))
    assert config.engine["kv_cache_dtype"] == stored


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDMM_API_KEY", "sk-env")
    assert config_from_args(build_parser().parse_args([])).api_keys == ("sk-env",)
    flag = config_from_args(build_parser().parse_args(["--api-key", "a", "b"]))
    assert flag.api_keys == ("a", "b")


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    # each option's entry: from its line in the options list to the next option's
    entries = {"-" + block.split()[0].rstrip(","): " ".join(block.split())
               for block in text.split("\n  -")[1:]}
    for option in ("--retention", "--speculation", "--admission", "--prefetch-lead-s",
                   "--shutdown-timeout", "--kv-offload-max-gib", "--speculation-gate"):
        assert "default" in entries[option], entries[option]


ERRORS = [
    (["Qwen/Qwen2.5-0.5B-Instruct"], "hub id"),
    (["/no/such/model"], "no such folder"),
    (["--dtype", "fp16"], "--dtype"),
    (["--max-model-len", "100000"], "--max-model-len 100000"),
    (["--model", "qwen2.5-7b"], "--load-format dummy"),
    (["tiny"], "edmm-tiny"),
    (["--enable-lora"], "--enable-lora"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
    (["--tool-call-parser", "mistral"], "--tool-call-parser"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--api-key"], "--api-key"),
]


@pytest.mark.parametrize(("argv", "named"), ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_each_command_line_error_is_one_line(argv: list[str], named: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and "Traceback" not in err, err


def test_cuda_on_a_cpu_build_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(SystemExit) as e:
        main(["--device", "cuda"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--device cuda" in err


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
def test_a_subprocess_error_has_no_traceback() -> None:
    done = subprocess.run([sys.executable, "-m", "edmm.server", "/no/such/model"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


# ---------------------------------------------------------------------------- live process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (from /proc's children lists)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += sorted(kids - found)
            found |= kids
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stream(url: str, results: list[tuple[bool, str]]) -> None:
    """One long streamed chat: (it ended with [DONE], its last data line before [DONE])."""
    body = {"model": "m", "stream": True, "max_tokens": 900, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    lines: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            lines = [ln for ln in response.iter_lines() if ln.startswith("data: ")]
    except httpx.HTTPError as e:
        results.append((False, repr(e)))
        return
    done = bool(lines) and lines[-1] == "data: [DONE]"
    results.append((done, lines[-2] if len(lines) > 1 else ""))


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
def test_vllm_style_serve_then_sigterm_drains_and_leaves_nothing(tiny_dir: Path) -> None:
    """A vLLM command line serves; SIGTERM with streams running: each stream ends complete or
    with an error event, both with [DONE]; the server exits 0 and no child process is left."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "edmm.server", str(tiny_dir), "--port", str(port),
         "--served-model-name", "m", "--max-model-len", "1024", "--api-key", KEY,
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--gpu-memory-utilization", "0.5", "--disable-uvicorn-access-log",
         "--shutdown-timeout", "0.5", "--kv-offload-max-gib", "0.25"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        ok = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": "m", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
        results: list[tuple[bool, str]] = []
        threads = [threading.Thread(target=_stream, args=(url, results)) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # the streams are running
        children = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for t in threads:
            t.join(timeout=60)
        assert len(results) == 3
        ended = 0
        for done, last in results:
            assert done, last  # every stream ends with [DONE] ...
            chunk = json.loads(last[len("data: "):])
            # ... after its last tokens (finished) or an error event (ended by the drain)
            assert "error" in chunk or chunk["choices"][0]["finish_reason"] == "length", chunk
            ended += "error" in chunk
        assert ended  # 900 tokens take the tiny model longer than the grace period
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if _alive(pid)]
        log = proc.stdout.read() if proc.stdout else ""
        for said in ("KV capacity:", "sessions at the full context", "context 1024 tokens",
                     "device cpu", "agent policy: EDMM", "API keys: 1"):
            assert said in log, said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start(tiny_dir: Path, port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "edmm.server", str(tiny_dir), "--port", str(port),
         "--max-model-len", "512", "--kv-offload-gib", "0"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "no server"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)


@pytest.mark.slow
def test_sigkill_leaves_no_process_and_the_next_start_cleans_semaphores(
        tiny_dir: Path) -> None:
    from edmm.server.children import clean_stale_semaphores, ledger_path

    proc = _start(tiny_dir, _free_port())
    try:
        children = _children(proc.pid)
        assert children  # the grammar probe's workers, the resource tracker
        ledger = ledger_path(proc.pid)
        names = ledger.read_text().split()[1:] if ledger.exists() else []
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if _alive(pid)]
        clean_stale_semaphores()  # what the next `edmm serve` does first
        assert not ledger.exists()
        assert not [n for n in names if (Path("/dev/shm") / n).exists()]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_clean_stale_semaphores_keeps_live_servers(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from edmm.server import children

    monkeypatch.setattr(children, "SHM", tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "sem.mp-dead1").touch()
    (tmp_path / "sem.mp-live1").touch()
    (tmp_path / f"{children.LEDGER_PREFIX}{dead.pid}").write_text("123 sem.mp-dead1 ../x")
    live = children._start_time(os.getpid())
    (tmp_path / f"{children.LEDGER_PREFIX}{os.getpid()}").write_text(f"{live} sem.mp-live1")
    assert children.clean_stale_semaphores() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{children.LEDGER_PREFIX}{os.getpid()}", "sem.mp-live1"]


def test_host_offload_is_sized_from_available_memory_and_capped() -> None:
    from edmm.server.state import OFFLOAD_SHARE, auto_offload_bytes

    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    sized = auto_offload_bytes(1 << 50)
    assert abs(sized - available * OFFLOAD_SHARE) < 0.05 * available  # memory moves a little
    assert auto_offload_bytes(1 << 20) == 1 << 20
    capped = config_from_args(build_parser().parse_args(["--kv-offload-max-gib", "0.5"]))
    assert capped.engine_config().kv_offload_bytes == min(1 << 29, sized)
    fixed = config_from_args(build_parser().parse_args(["--kv-offload-gib", "0"]))
    assert fixed.engine_config().kv_offload_bytes == 0
