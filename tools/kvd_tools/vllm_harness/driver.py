"""Runs in the tests' and `kvd bench vllm`'s process: starts and drives a vLLM engine child.

Each engine runs in its own process group: vLLM's engine core and TP workers
outlive their parent otherwise, so `stop()` ends the whole group.

`EngineProcess.outputs` returns each prompt's greedy tokens with the top
logprobs of each, and `differences` compares two engines' outputs: the same
tokens, and each top logprob within `LOGPROB_TOLERANCE`.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START_S = 300.0  # an engine takes 30 to 60 s to start on a 2-core machine
TOP_LOGPROBS = 5
# How far one logprob may move when the same KV reaches vLLM by another path
# (bf16 kernels on a prefix from a cache against a whole prompt's prefill).
LOGPROB_TOLERANCE = 0.05


@dataclass(frozen=True)
class Output:
    """One prompt's greedy tokens, and per token the likeliest ids: (id, logprob) pairs."""

    tokens: list[int]
    logprobs: list[list[tuple[int, float]]]


def differences(
    got: list[Output],
    want: list[Output],
    tolerance: float = LOGPROB_TOLERANCE,
    *,
    ties: bool = False,
) -> list[str]:
    """Where `got` is not `want`: a token, or a top logprob further than `tolerance`
    (an id in one top list only is fine where it ties the other's last within it).

    With `ties`, greedy tokens may part where the two ids were within `tolerance`
    of each other in `want` (a near-tie, which bf16 noise decides either way); the
    positions after that are conditioned on other tokens and are not compared."""
    found: list[str] = []
    if len(got) != len(want):
        return [f"{len(got)} outputs, not {len(want)}"]
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        compared = len(w.logprobs)
        if g.tokens != w.tokens:
            parted = zip(g.tokens, w.tokens, strict=False)
            t = next((i for i, (a, b) in enumerate(parted) if a != b), len(w.tokens))
            top = dict(w.logprobs[t]) if t < min(len(g.tokens), len(w.logprobs)) else {}
            tie = g.tokens[t] in top and w.tokens[t] in top if top else False
            if ties and tie and top[w.tokens[t]] - top[g.tokens[t]] <= tolerance:
                compared = t + 1
            else:
                found.append(f"prompt {n}: tokens {g.tokens} != {w.tokens}")
        for t, (gt, wt) in enumerate(
            zip(g.logprobs[:compared], w.logprobs[:compared], strict=False)
        ):
            ours, theirs = dict(gt), dict(wt)
            for a, b, name in ((ours, theirs, "got"), (theirs, ours, "want")):
                for token, lp in a.items():
                    if token in b:
                        if abs(lp - b[token]) > tolerance:
                            found.append(
                                f"prompt {n} token {t}: id {token} logprob {ours[token]:.4f} "
                                f"!= {theirs[token]:.4f}"
                            )
                    elif lp > min(b.values()) + tolerance:
                        found.append(
                            f"prompt {n} token {t}: id {token} ({lp:.4f}) in the top of {name} only"
                        )
        if len(g.logprobs) != len(w.logprobs):
            found.append(f"prompt {n}: {len(g.logprobs)} logprobs, not {len(w.logprobs)}")
    return sorted(set(found), key=found.index)


def largest_difference(got: list[Output], want: list[Output]) -> float:
    """The largest move of a logprob of an id in both top lists (inf for other tokens)."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if g.tokens != w.tokens:
            return float("inf")
        for gt, wt in zip(g.logprobs, w.logprobs, strict=True):
            theirs = dict(wt)
            worst = max([worst, *(abs(lp - theirs[i]) for i, lp in gt if i in theirs)])
    return worst


class EngineProcess:
    """One vLLM engine process speaking JSON lines (`kvd_tools.vllm_harness.engine`)."""

    def __init__(
        self,
        config: dict[str, Any],
        *,
        env: dict[str, str] | None = None,
        python: str | None = None,
    ) -> None:
        """`python`: the interpreter of another venv (LMCache's, for `kvd bench peers`),
        which must import vLLM and `kvd_tools.vllm_harness.engine`; default this one."""
        tp = config.get("tp", 1)
        environ = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "auto",
            # vLLM's CPU build reserves one more core a rank for any KV connector (for
            # NIXL); on 2 cores that leaves its scheduler none. Every engine here,
            # with a connector or without, gets vLLM's own layout (docs/vllm.md).
            "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", str(tp)),
            # vLLM logs to stdout by default, from the engine core's process too:
            # a warning could land inside a reply line. Its logs go to the log file.
            "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        }
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix="kvd-vllm-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [python or sys.executable, "-m", "kvd_tools.vllm_harness.engine", json.dumps(config)],
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

    def outputs(
        self,
        prompts: list[list[int]],
        max_tokens: int = 8,
        logprobs: int = TOP_LOGPROBS,
        timeout: float = 600,
    ) -> list[Output]:
        """Greedy tokens with the `logprobs` likeliest ids of each (`differences`)."""
        cmd = {"prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs}
        reply = self.ask(cmd, timeout)
        return [
            Output(tokens, [[(int(i), float(lp)) for i, lp in top] for top in tops])
            for tokens, tops in zip(reply["tokens"], reply["logprobs"], strict=True)
        ]

    def timed(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
        """Tokens, and the seconds `LLM.generate` took inside the engine process."""
        reply = self.ask({"prompts": prompts, "max_tokens": max_tokens})
        return reply["tokens"], float(reply["seconds"])

    def metrics(self) -> dict[str, float]:
        """vLLM's own `vllm:kv_offload*` counters (the connector's and kvd's figures)."""
        figures: dict[str, float] = self.ask({"metrics": True})["metrics"]
        return figures

    def reset_prefix_cache(self, reset_connector: bool = False, timeout: float = 600) -> None:
        """vLLM's `reset_prefix_cache`; with `reset_connector`, the connector's too."""
        cmd = {"reset_prefix_cache": True, "reset_connector": reset_connector}
        if self.ask(cmd, timeout) != {"ok": True}:
            raise RuntimeError("reset_prefix_cache was not acknowledged")

    def abort(
        self, prompts: list[list[int]], steps: int, max_tokens: int = 64, timeout: float = 600
    ) -> int:
        """Starts `prompts`, aborts those still running after `steps` engine steps;
        returns how many were aborted."""
        cmd = {"prompts": prompts, "abort": steps, "max_tokens": max_tokens}
        aborted: int = self.ask(cmd, timeout)["aborted"]
        return aborted

    def pin(self, cpus: set[int]) -> int:
        """Binds every thread of the engine's processes (the harness, vLLM's engine
        core and workers: its session) to `cpus`, but those already bound within
        them (vLLM's OpenMP threads, one a core: left as they are); returns how
        many threads it bound. It looks again until a pass finds no thread it has
        not seen (one started meanwhile by a thread not yet bound); threads
        started later inherit the binding of the thread that starts them."""
        seen: set[int] = set()
        pinned = 0
        while True:
            found = self._threads() - seen
            if not found:
                break
            seen |= found
            for tid in found:
                try:
                    if os.sched_getaffinity(tid) <= cpus:
                        continue
                    os.sched_setaffinity(tid, cpus)
                    pinned += 1
                except ProcessLookupError:
                    continue  # it ended meanwhile
        if not seen:
            raise RuntimeError(f"no thread of engine {self.proc.pid} to bind to {sorted(cpus)}")
        return pinned

    def _threads(self) -> set[int]:
        """The thread ids of every process in the engine's session (`start_new_session`:
        the session id is the harness's pid)."""
        tids: set[int] = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                if int(stat[stat.rfind(")") + 2 :].split()[3]) != self.proc.pid:
                    continue  # another session's process (field 6: the session id)
                tids.update(int(task.name) for task in (entry / "task").iterdir())
            except (FileNotFoundError, ProcessLookupError):
                continue  # it ended meanwhile
        return tids

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

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
