"""Benchmark: how long the weights' shape check (``job.weight_shapes``) takes for production-sized
configs, against nothing but their config.json and safetensors headers.

For each case it writes the config and one header-only safetensors file holding every tensor the
architecture has (its names and shapes; no tensor data, which the check never reads), times
``check_tensor_shapes`` on it, then on the same header with one expert's tensor a column short
(the error it must raise). Prints a table and appends one row per case to
docs/benchmarks/results.jsonl (``config: weight_shapes``)::

    python -m job.benchmarks.weight_shapes

Cases: DeepSeek-V3's config (61 layers, 256 routed experts, 671B parameters), and Kimi-K2's
(61 layers, 384 routed experts, 1.0T parameters) without its quantization_config (quantized
checkpoints are skipped: this is the largest unquantized architecture the check would build).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from job.benchmarks.throughput import KIMI_K2_PROXY
from job.errors import ConfigError
from job.weight_shapes import architecture_shapes, check_tensor_shapes

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "benchmarks" / "results.jsonl"
_FULL_DEPTH = {k: v for k, v in KIMI_K2_PROXY.items() if k != "quantization_config"} | {
    "num_hidden_layers": 61
}
CASES: dict[str, dict[str, Any]] = {
    "deepseek-v3": _FULL_DEPTH
    | {
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "vocab_size": 129280,
    },
    "kimi-k2": _FULL_DEPTH,
}
WRONG = "model.layers.30.mlp.experts.7.down_proj.weight"


def _write_header(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    header = {n: {"dtype": "BF16", "shape": list(s), "data_offsets": [0, 0]} for n, s in shapes.items()}
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)


def run_case(name: str, config: dict[str, Any], work: Path) -> dict[str, Any]:
    model = work / name
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    shapes = architecture_shapes(model)
    assert not isinstance(shapes, str), shapes
    _write_header(model / "model.safetensors", shapes)
    started = time.monotonic()
    check = check_tensor_shapes(model, config)
    passed = time.monotonic() - started
    assert check.skipped is None and check.compared == len(shapes), check
    names = dict(shapes)
    wrong = WRONG if WRONG in names else next(n for n in names if ".experts." in n)
    names[wrong] = (*names[wrong][:-1], names[wrong][-1] - 1)
    _write_header(model / "model.safetensors", names)
    started = time.monotonic()
    try:
        check_tensor_shapes(model, config)
        raise AssertionError("a wrong shape passed")
    except ConfigError as exc:
        assert wrong in str(exc), exc
    refused = time.monotonic() - started
    import transformers

    return {
        "run_id": datetime.now().strftime("%Y%m%dT%H%M%SZ"),
        "config": "weight_shapes",
        "case": name,
        "parameters_billion": round(sum(math.prod(s) for s in shapes.values()) / 1e9, 1),
        "tensors": len(shapes),
        "compared": check.compared,
        "seconds_passed": round(passed, 2),
        "seconds_refused": round(refused, 2),
        "transformers": transformers.__version__,
        "cores": os.cpu_count(),
        "load_average": [round(x, 1) for x in os.getloadavg()[:2]],
        "notes": "check_tensor_shapes on config.json and a header-only safetensors file, its build included",
    }


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="weight-shapes-") as work:
        for name, config in CASES.items():
            rows.append(run_case(name, config, Path(work)))
    print(f"{'case':12} {'params':>8} {'tensors':>8} {'passed s':>9} {'refused s':>10}  load")
    for row in rows:
        print(
            f"{row['case']:12} {row['parameters_billion']:>7}B {row['tensors']:>8} "
            f"{row['seconds_passed']:>9} {row['seconds_refused']:>10}  {row['load_average']}"
        )
    with RESULTS.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
