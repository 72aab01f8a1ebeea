"""The KV store on the real vLLM (CPU build): its cost while serving and what it saves.

Runs the engine the e2e lane installs (``make e2e-vllm-tools``) as local processes with
the flags the operator writes, no cluster, in one run:

1. **Throughput, store off and on.** The same fixed multi-turn workload (sessions of
   several turns on long system prompts, temperature 0, a fixed answer length) against
   a fresh engine without the store, then against a fresh engine with it, in turn for
   ``--rounds`` rounds. The figure is completion tokens per second, and the ratio of the
   medians on/off.
2. **Save cost.** From the store's own counters on vLLM's /metrics after the "on" run:
   seconds and bytes per 1,000 tokens saved.
3. **Restart.** A fresh engine on the same store replays each session's next turn: time
   to answer, and tokens loaded, against the same turns on a fresh engine without the
   store (a full prefill); load seconds per 1,000 tokens from the counters.

Timings are what this machine gave in this run (2 shared cores, vLLM reserving one):
ratios measured side by side, not absolute speeds of a GPU.

    make bench-kvstore BENCH_KVSTORE_ARGS="--sessions 6 --turns 6"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))  # appended: the root's operator/ must not hide the stdlib's

from e2e.localcluster._vllm import (  # noqa: E402
    MODEL_NAME,
    VllmInstall,
    vllm_argv,
    vllm_env,
    vllm_root,
)

SYSTEM = " ".join(f"word{i}" for i in range(600))
"""About 2,700 tokens, as the e2e lane's system prompt (each session's starts apart)."""
PORT = 18231


def store_config(root: Path) -> str:
    """The operator's ``--kv-transfer-config`` for a store at ``root``."""
    from sessionfleet.engines.kvstore_wire import CONNECTOR_CLASS, CONNECTOR_MODULE

    return json.dumps(
        {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"root": str(root), "max_bytes": 0},
        }
    )


class Engine:
    """One vLLM server process, with or without the store."""

    def __init__(self, install: VllmInstall, work: Path, store: Path | None) -> None:
        args = [
            MODEL_NAME,
            "--served-model-name",
            MODEL_NAME,
            f"--port={PORT}",
            "--host=127.0.0.1",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--enable-force-include-usage",
        ]
        if store is not None:
            args += ["--kv-transfer-config", store_config(store)]
        env = {**os.environ, **vllm_env(install, work / "scratch", work), "PYTHONHASHSEED": "0"}
        self.log = work / f"engine-{time.monotonic_ns()}.log"
        self.process = subprocess.Popen(
            vllm_argv(install, args, "127.0.0.1"),
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{PORT}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the engine exited; see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"the engine did not start in 300 s; see {self.log}")

    def stop(self) -> None:
        """Stop the engine's whole process group."""
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def counters(self) -> dict[str, float]:
        """The store's counters from vLLM's /metrics (summed over labels)."""
        found: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name.startswith("sessionfleet:kvstore_") and name.endswith("_total"):
                key = name.removeprefix("sessionfleet:kvstore_").removesuffix("_total")
                found[key] = found.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return found


def ask(
    engine: Engine, session: str, messages: list[dict[str, str]], answer_tokens: int
) -> dict[str, Any]:
    """One turn; returns vLLM's usage and the seconds it took."""
    started = time.monotonic()
    response = httpx.post(
        f"{engine.url}/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": messages,
            "max_tokens": answer_tokens,
            "min_tokens": answer_tokens,
            "temperature": 0,
        },
        headers={"X-Session-ID": session},
        timeout=300,
    )
    response.raise_for_status()
    body = response.json()
    usage = body["usage"]
    return {
        "seconds": time.monotonic() - started,
        "prompt": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "completion": usage["completion_tokens"],
        "answer": body["choices"][0]["message"]["content"],
    }


def workload(
    engine: Engine, args: argparse.Namespace
) -> tuple[dict[str, Any], list[list[dict[str, str]]]]:
    """The fixed multi-turn workload, sessions taking turns; its figures and histories."""
    # Each session's prompt differs from its first block on: no session serves another.
    histories = [
        [{"role": "system", "content": f"Session {index}. {SYSTEM}"}]
        for index in range(args.sessions)
    ]
    turns = []
    started = time.monotonic()
    for step in range(args.turns):
        for index, history in enumerate(histories):
            words = " ".join(f"s{index}t{step}w{i}" for i in range(args.turn_words))
            history.append({"role": "user", "content": words})
            turn = ask(engine, f"bench-{index}", history, args.answer_tokens)
            history.append({"role": "assistant", "content": turn["answer"]})
            turns.append(turn)
    elapsed = time.monotonic() - started
    completion = sum(t["completion"] for t in turns)
    return (
        {
            "turns": len(turns),
            "seconds": round(elapsed, 2),
            "completion_tokens": completion,
            "completion_tokens_per_second": round(completion / elapsed, 1),
            "prompt_tokens": sum(t["prompt"] for t in turns),
            "cached_tokens": sum(t["cached"] for t in turns),
        },
        histories,
    )


def replay(
    engine: Engine, histories: list[list[dict[str, str]]], answer_tokens: int
) -> dict[str, Any]:
    """Each session's next turn on a fresh engine: seconds and tokens loaded."""
    turns = [
        ask(
            engine,
            f"bench-{index}",
            [*history, {"role": "user", "content": "after the restart"}],
            answer_tokens,
        )
        for index, history in enumerate(histories)
    ]
    return {
        "seconds_median": round(statistics.median(t["seconds"] for t in turns), 3),
        "prompt_tokens": sum(t["prompt"] for t in turns),
        "cached_tokens": sum(t["cached"] for t in turns),
        "answers": [t["answer"] for t in turns],
    }


def per_thousand(seconds: float, blocks: float, block_tokens: int) -> float | None:
    return round(1000 * seconds / (blocks * block_tokens), 5) if blocks else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--turn-words", type=int, default=12, help="new words each turn")
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs of workload runs")
    parser.add_argument("--block-tokens", type=int, default=128, help="vLLM CPU's block size")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "bench-kvstore.json")
    args = parser.parse_args()
    install = VllmInstall(vllm_root())
    if (missing := install.missing()) is not None:
        raise SystemExit(missing)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="sf-bench-kv-") as temp:
        work = Path(temp)
        store = work / "store"
        rates: dict[str, list[float]] = {"off": [], "on": []}
        runs: dict[str, Any] = {}
        histories: list[list[dict[str, str]]] = []
        # Off and on in turn, each round on fresh engines (and the store emptied), so the
        # machine's drift over the run falls on both alike.
        for round_ in range(args.rounds):
            for name, root in (("off", None), ("on", store)):
                shutil.rmtree(store, ignore_errors=True)
                engine = Engine(install, work, root)
                try:
                    runs[name], histories = workload(engine, args)
                    time.sleep(12)  # vLLM publishes connector counters with its stats (10 s)
                    runs[name]["counters"] = engine.counters()
                finally:
                    engine.stop()
                rates[name].append(runs[name]["completion_tokens_per_second"])
                print(f"round {round_ + 1}, store {name}: {runs[name]}", file=sys.stderr)
        result["throughput"] = {**runs, "completion_tokens_per_second": rates}
        result["throughput_ratio_on_off"] = round(
            statistics.median(rates["on"]) / statistics.median(rates["off"]), 3
        )
        saved = runs["on"]["counters"]
        blocks = saved.get("blocks_saved", 0.0)
        result["save"] = {
            "blocks": blocks,
            "dropped": saved.get("blocks_dropped", 0.0),
            "errors": saved.get("save_errors", 0.0),
            "seconds_per_1000_tokens": per_thousand(
                saved.get("save_seconds", 0.0), blocks, args.block_tokens
            ),
            "bytes_per_token": round(
                saved.get("bytes_saved", 0.0) / (blocks * args.block_tokens), 1
            )
            if blocks
            else None,
        }
        restarts: dict[str, Any] = {}
        for name, root in (("recompute", None), ("store", store)):
            engine = Engine(install, work, root)
            try:
                restarts[name] = replay(engine, histories, args.answer_tokens)
                time.sleep(12)
                restarts[name]["counters"] = engine.counters()
            finally:
                engine.stop()
            print(f"restart, {name}: {restarts[name]}", file=sys.stderr)
        loaded = restarts["store"]["counters"]
        result["restart"] = {
            name: {k: v for k, v in run.items() if k != "answers"} for name, run in restarts.items()
        }
        result["restart"]["same_answers"] = (
            restarts["store"]["answers"] == restarts["recompute"]["answers"]
        )
        result["restart"]["time_ratio_store_recompute"] = round(
            restarts["store"]["seconds_median"] / restarts["recompute"]["seconds_median"], 3
        )
        result["load"] = {
            "blocks": loaded.get("blocks_loaded", 0.0),
            "misses": loaded.get("load_misses", 0.0),
            "seconds_per_1000_tokens": per_thousand(
                loaded.get("load_seconds", 0.0), loaded.get("blocks_loaded", 0.0), args.block_tokens
            ),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=2))


if __name__ == "__main__":
    main()
