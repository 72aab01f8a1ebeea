"""Drive an OpenAI-compatible endpoint with kubernetes-sigs' inference-perf.

inference-perf (https://github.com/kubernetes-sigs/inference-perf, on PyPI) is the load
generator llm-d and the Gateway API Inference Extension benchmark with. This module
writes its configuration, runs it and reads its summary; ``bench/router/run.py
--load-tool inference-perf`` uses it to drive the same engine directly and through the
router, interleaved, in one run. The tool is installed by ``bench/loadtool/install.sh``
into a virtual environment of its own under the tool cache (it needs Python >= 3.12 and
brings transformers, which the project does not depend on).

The workload is inference-perf's ``shared_prefix`` generator with multi-turn chat: a
number of groups, each with a shared system prompt, whose prompts are sent as the turns
of user sessions; every request carries its session id in the ``X-Session-Id`` header
(inference-perf's ``api.session_id_header_key``), so the router does its per-session
work (session creation on the first turn, binding lookup, usage accounting). Prompt
lengths are counted with a local tokenizer (``tokenizer``), as inference-perf needs one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

INSTALL = Path(__file__).with_name("install.sh")


def install() -> Path:
    """Install inference-perf (once) and return its executable."""
    done = subprocess.run(["bash", str(INSTALL)], check=True, capture_output=True, text=True)
    return Path(done.stdout.strip().splitlines()[-1])


def config(
    *,
    base_url: str,
    model: str,
    tokenizer: Path,
    rate: float,
    duration: int,
    groups: int,
    prompts_per_group: int,
    reports: Path,
    streaming: bool = True,
) -> dict[str, Any]:
    """Return an inference-perf configuration: one constant-rate stage of multi-turn chat."""
    return {
        "api": {
            "type": "completion",
            "streaming": streaming,
            "session_id_header_key": "X-Session-Id",
        },
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": groups,
                "num_prompts_per_group": prompts_per_group,
                "system_prompt_len": 256,
                "question_len": 64,
                "output_len": 16,
                "enable_multi_turn_chat": True,
                "seed": 7,
            },
        },
        "load": {
            "type": "constant",
            "stages": [{"rate": rate, "duration": duration}],
            "num_workers": 1,
        },
        "server": {"type": "vllm", "model_name": model, "base_url": base_url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "storage": {"local_storage": {"path": str(reports)}},
    }


def run(binary: Path, settings: dict[str, Any], work: Path) -> tuple[str, dict[str, Any]]:
    """Run inference-perf once; return what it printed and its summary report."""
    reports = Path(settings["storage"]["local_storage"]["path"])
    reports.mkdir(parents=True, exist_ok=True)
    config_file = work / f"{reports.name}.json"
    # inference-perf reads YAML; JSON is YAML.
    config_file.write_text(json.dumps(settings))
    env = {
        **os.environ,
        # Offline: the tokenizer is a local folder; nothing is downloaded.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # Its tables are drawn by rich, which cuts columns to the terminal's width.
        "COLUMNS": "200",
    }
    done = subprocess.run(
        [str(binary), "--config_file", str(config_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(
            f"inference-perf failed ({done.returncode}):\n{done.stdout[-3000:]}"
            f"\n{done.stderr[-3000:]}"
        )
    summary = json.loads((reports / "summary_lifecycle_metrics.json").read_text())
    return done.stdout, summary


def figures(summary: dict[str, Any]) -> dict[str, float]:
    """Return the figures quoted from a summary: rate, successes, latency and TTFT in ms."""
    successes = summary["successes"]
    latency = successes["latency"]
    out = {
        "requests": float(successes["count"]),
        "failures": float(summary.get("failures", {}).get("count", 0)),
        "seconds": round(summary["benchmark_time_seconds"], 2),
    }
    for name, key in (("latency", "request_latency"), ("ttft", "time_to_first_token")):
        for quantile in ("median", "p90", "p99"):
            out[f"{name}_{quantile}_ms"] = round(latency[key][quantile] * 1000, 2)
    out["rate"] = round(out["requests"] / out["seconds"], 1)
    return out
