"""Runs in the tests' and `kvd bench vllm`'s process: starts and drives a vLLM engine child.

Each engine runs in its own process group: vLLM's engine core and TP workers
outlive their parent otherwise, so `stop()` ends the whole group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

START_S = 300.0  # an engine takes 30 to 60 s to start on a 2-core machine


class EngineProcess:
    """One vLLM engine process speaking JSON lines (`kvd_tools.vllm_harness.engine`)."""

    def __init__(self, config: dict[str, Any], *, env: dict[str, str] | None = None) -> None:
        tp = config.get("tp", 1)
        environ = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "auto",
            # vLLM logs to stdout by default, from the engine core's process too:
            # a warning could land inside a reply line. Its logs go to the log file.
            "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        }
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix="kvd-vllm-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvd_tools.vllm_harness.engine", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**environ, **(env or {})},
            start_new_session=True,  # vLLM's engine core and workers go with it on stop
        )
        try:
            ready = self._read(timeout=START_S)
        except BaseException:
            self.stop()
            raise
        if ready != {"ready": True}:
            self.stop()
            raise RuntimeError(f"engine did not start: {ready!r}")

    def log_tail(self, chars: int = 6000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def _read(self, timeout: float) -> Any:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine exited with {self.proc.poll()}:\n{self.log_tail()}")
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        raise TimeoutError(f"engine did not answer:\n{self.log_tail()}")

    def ask(self, cmd: dict[str, Any], timeout: float = 600) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
        tokens: list[list[int]] = self.ask({"prompts": prompts, "max_tokens": max_tokens})["tokens"]
        return tokens

    def timed(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
        """Tokens, and the seconds `LLM.generate` took inside the engine process."""
        reply = self.ask({"prompts": prompts, "max_tokens": max_tokens})
        return reply["tokens"], float(reply["seconds"])

    def metrics(self) -> dict[str, float]:
        """vLLM's own `vllm:kv_offload*` counters (the connector's and kvd's figures)."""
        figures: dict[str, float] = self.ask({"metrics": True})["metrics"]
        return figures

    def reset_prefix_cache(self) -> None:
        if self.ask({"reset_prefix_cache": True}) != {"ok": True}:
            raise RuntimeError("reset_prefix_cache was not acknowledged")

    def stop(self) -> None:
        """Stops the engine and every process vLLM started for it (its process group)."""
        stop_group(self.proc)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to `proc`'s process group, SIGKILL to what is left after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine core and workers too
    proc.wait()
