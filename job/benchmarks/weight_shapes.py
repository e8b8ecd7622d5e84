"""Benchmark: how long the weights' checks against config.json (``job.weight_names``,
``job.weight_shapes``: the architecture built on the meta device, then names and shapes compared)
take for production-sized configs, against nothing but their config.json and safetensors headers.

For each case it writes the config and one header-only safetensors file holding every tensor the
architecture has (its names and shapes, INT4-packed where the config quantizes; no tensor data,
which the checks never read), times the checks as ``run`` makes them, then on the same header with
one expert's tensor renamed (the names' error) and, unquantized, with one a column short (the
shapes' error). Prints a table and appends one row per case to docs/benchmarks/results.jsonl
(``config: weight_shapes``)::

    python -m job.benchmarks.weight_shapes

Cases: DeepSeek-V3's config (61 layers, 256 routed experts, 671B parameters); Kimi-K2's (61
layers, 384 routed experts, 1.0T parameters) without its quantization_config (the largest
unquantized architecture the checks build), and with K2.5's INT4 one (routed experts
compressed-tensors pack-quantized: weight_packed, weight_scale and weight_shape in place of
weight, checked module by module; shapes not compared).
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from job.architecture import build_architecture
from job.benchmarks.throughput import KIMI_K2_PROXY
from job.errors import ConfigError
from job.weight_names import check_tensor_names
from job.weight_shapes import check_tensor_shapes
from job.weights import checkpoint_tensors

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "benchmarks" / "results.jsonl"
_KIMI_K2 = KIMI_K2_PROXY | {"num_hidden_layers": 61}
_UNQUANTIZED = {k: v for k, v in _KIMI_K2.items() if k != "quantization_config"}
CASES: dict[str, dict[str, Any]] = {
    "deepseek-v3": _UNQUANTIZED
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
    "kimi-k2": _UNQUANTIZED,
    "kimi-k2-int4": _KIMI_K2,
}
WRONG = "model.layers.30.mlp.experts.7.down_proj"
_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")  # what K2.5 quantizes
_PACK, _GROUP = 8, 32  # INT4 values per int32, and per scale


def _header(
    config: dict[str, Any], shapes: dict[str, tuple[int, ...]]
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors (name -> dtype, shape) for the architecture's ``shapes``."""
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        if "quantization_config" not in config or not _EXPERT.search(name):
            tensors[name] = ("BF16", shape)
            continue
        module = name.removesuffix(".weight")
        out, into = shape
        tensors[f"{module}.weight_packed"] = ("I32", (out, into // _PACK))
        tensors[f"{module}.weight_scale"] = ("BF16", (out, into // _GROUP))
        tensors[f"{module}.weight_shape"] = ("I32", (2,))
    return tensors


def _write(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    header = {n: {"dtype": d, "shape": list(s), "data_offsets": [0, 0]} for n, (d, s) in tensors.items()}
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)


def _checks(model: Path, config: dict[str, Any]) -> tuple[Any, Any]:
    """The checks as ``run`` makes them (job.pipeline.setup.check_model_weights)."""
    tensors = checkpoint_tensors(model)
    assert not isinstance(tensors, str), tensors
    architecture = build_architecture(model, trust_remote_code=False)
    names = check_tensor_names(model, config, architecture, tensors)
    return names, check_tensor_shapes(model, config, architecture, tensors)


def _refused(model: Path, config: dict[str, Any], tensors: dict[str, Any], wrong: str) -> float:
    _write(model / "model.safetensors", tensors)
    started = time.monotonic()
    try:
        _checks(model, config)
        raise AssertionError(f"{wrong} passed")
    except ConfigError as exc:
        assert wrong in str(exc), exc
    return time.monotonic() - started


def run_case(name: str, config: dict[str, Any], work: Path) -> dict[str, Any]:
    model = work / name
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    architecture = build_architecture(model, trust_remote_code=False)
    assert not isinstance(architecture, str), architecture
    tensors = _header(config, architecture.shapes)
    _write(model / "model.safetensors", tensors)
    started = time.monotonic()
    names, shapes = _checks(model, config)
    passed = time.monotonic() - started
    assert names.skipped is None and names.by_name + names.by_module == len(tensors), names
    renamed = {n.replace(WRONG + ".", WRONG + "_renamed."): v for n, v in tensors.items()}
    row: dict[str, Any] = {"seconds_refused_name": round(_refused(model, config, renamed, WRONG), 2)}
    if shapes.skipped is None:
        weight = WRONG + ".weight"
        dtype, shape = tensors[weight]
        short = {**tensors, weight: (dtype, (*shape[:-1], shape[-1] - 1))}
        row["seconds_refused_shape"] = round(_refused(model, config, short, weight), 2)
    import transformers

    return {
        "run_id": datetime.now().strftime("%Y%m%dT%H%M%SZ"),
        "config": "weight_shapes",
        "case": name,
        "parameters_billion": round(sum(math.prod(s) for s in architecture.shapes.values()) / 1e9, 1),
        "tensors": len(tensors),
        "by_name": names.by_name,
        "by_module": names.by_module,
        "shapes_compared": shapes.compared,
        "seconds_passed": round(passed, 2),
        **row,
        "transformers": transformers.__version__,
        "cores": os.cpu_count(),
        "load_average": [round(x, 1) for x in os.getloadavg()[:2]],
        "notes": "names and shapes checked on config.json and a header-only safetensors file, the "
        "architecture's build included",
    }


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="weight-shapes-") as work:
        for name, config in CASES.items():
            rows.append(run_case(name, config, Path(work)))
    print(f"{'case':13} {'params':>8} {'tensors':>8} {'passed s':>9} {'name s':>7} {'shape s':>8}  load")
    for row in rows:
        shape = row.get("seconds_refused_shape", "-")
        print(
            f"{row['case']:13} {row['parameters_billion']:>7}B {row['tensors']:>8} "
            f"{row['seconds_passed']:>9} {row['seconds_refused_name']:>7} {shape:>8}  {row['load_average']}"
        )
    with RESULTS.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
