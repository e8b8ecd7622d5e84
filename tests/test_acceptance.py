"""The serving contract at CPU scale: a draft trained on the job's data, served by vLLM's own EAGLE-3.

``python -m job.benchmarks.acceptance`` as it runs on a GPU, cut down to this machine: the real
SmolLM2-135M-Instruct (builtin:smollm2-135m-instruct), in float32, answers 8 MT-bench prompts
greedily through the job on vLLM, speculators trains a draft on the job's reference export (on the CPU:
tests/speculators_cpu.py), and vLLM decodes the same prompts with that draft at k = 1 and
temperature 0, and with the same draft's auxiliary layer ids shifted by one. A CPU-sized training
only gets tokens accepted by learning the very answers it is served on, so this draft does: the
test is about the contract, not about what the data is worth (the GPU benchmark is).

At k = 1 and temperature 0, vLLM's acceptance of each prompt follows from the draft's first-token
predictions alone, so the offline step computes it exactly from our stored hidden states (the
draft reads the states of position i and token i+1 and predicts token i+2; the next draft is 2
positions on after an acceptance, else 1). A convention slip between what the job stores and what
vLLM feeds a draft at serving time (a layer off by one, a one-position shift, the wrong loss
positions, states after the final norm) makes the two differ; the shifted draft shows that a slip
of one layer is visible at all.

Needs speculative decoding on a CPU build: vllm-cpu 0.26 (0.16's CPU runner refuses it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import VLLM_CPU_ENV, needs_real_model, real_model_wheel_dir

REPO = Path(__file__).resolve().parents[1]


def _cpu_spec_decode() -> bool:
    try:
        from vllm.v1.worker import cpu_model_runner
    except ImportError:
        return False
    return "spec decode is not supported" not in Path(cpu_model_runner.__file__).read_text()


needs_cpu_spec_decode = pytest.mark.skipif(
    not _cpu_spec_decode(), reason="this vLLM's CPU runner has no speculative decoding (vllm-cpu >= 0.26)"
)


@pytest.mark.vllm
@pytest.mark.vllm_line  # vLLM's EAGLE-3 serving of this line (.ci/run: those with CPU spec decoding)
@needs_real_model
@needs_cpu_spec_decode
def test_vllm_accepts_what_the_draft_predicts_offline_and_a_layer_slip_shows(
    smollm2_dir: Path, job_env: dict[str, str], tmp_path: Path
) -> None:
    work = tmp_path / "acceptance"
    rows = tmp_path / "results.jsonl"
    # a small step: vLLM's CPU runner warms up with a forward of a whole step's tokens
    engine = json.dumps({"enforce_eager": True, "block_size": 16, "max_num_batched_tokens": 512})
    command = [
        sys.executable, "-m", "job.benchmarks.acceptance",
        "prompts", "heldout", "export", "train", "serve", "offline", "report",
        "--work", str(work), "--wheels", str(real_model_wheel_dir()), "--results", str(rows),
        "--variants", "job_bf16", "--train-on", "heldout", "--train-prompts", "1", "--heldout-prompts", "8",
        "--max-length", "512", "--serve-max-tokens", "32",
        "--job-arg=--backend.name=vllm", "--job-arg=--backend.vllm.enforce_eager=true",
        "--job-arg=--backend.vllm.max_num_batched_tokens=512",
        "--trainer", sys.executable, str(REPO / "tests" / "speculators_cpu.py"),
        # on a CPU: no bf16 autocast, AdamW (speculators' default Muon spends minutes a step here)
        "--train-arg=--draft-attn-impl=sdpa", "--train-arg=--loss-implementation=eager",
        "--train-arg=--num-workers=0", "--train-arg=--ttt-steps=1", "--train-arg=--optimizer=adamw",
        "--train-arg=--hidden-states-dtype=float32", "--train-arg=--checkpoint-freq=25",
        "--epochs", "25", "--lr", "1e-3", "--draft-vocab-size", "4096", "--total-seq-len", "2048",
        "--k", "1", "--temperatures", "0", "--per-prompt", "--engine-args", engine,
        # float32: in bf16 a near-tie flips a greedy answer between the job's decoding and spec
        # decoding's verification (CI's CPU, 2026-12-07: 3 of 8 answers, 2 % of stored positions)
        "--dtype", "float32",
    ]  # fmt: skip
    env = {**job_env, **VLLM_CPU_ENV}
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=2400)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]

    offline = json.loads((work / "state.json").read_text())["offline"]
    right = json.loads((work / "serve" / "job_bf16-k1.json").read_text())["runs"][0]
    shifted = json.loads((work / "serve" / "job_bf16_shifted_layers-k1.json").read_text())["runs"][0]
    online = right["acceptance_per_position"][0]
    walks = offline["k1_per_sample"]
    # where vLLM decoded another answer than the stored one, the walk over the stored one is moot
    as_stored = [i for i in walks if i not in right["other_answers"]]
    same = [i for i in as_stored if right["per_prompt"][i] == walks[i]]
    shifted_as_stored = [i for i in walks if i not in shifted["other_answers"]]
    shifted_differ = [i for i in shifted_as_stored if shifted["per_prompt"][i] != walks[i]]
    print(
        f"\noffline k=1 {offline['k1_acceptance']} ({offline['k1_drafts']} drafts), online {online} "
        f"({right['drafts']}), shifted {shifted['acceptance_per_position'][0]}; greedy answers as "
        f"stored: {len(as_stored)}/{len(walks)}; of those, the same drafts and acceptances online as "
        f"offline: {len(same)}; shifted: {len(shifted_as_stored)} as stored, {len(shifted_differ)} of them "
        f"with other counts"
    )
    summary = f"offline {offline}, online {right}, shifted {shifted}"
    # the stored final layer is the target's own: its head's argmax is the greedy answer (float32:
    # measured 1.0; a layer or position slip of the final state drops it far)
    assert offline["target_agreement"] > 0.99, summary
    # spec decoding decodes what the job stored (float32: 8 of 8), and the draft learned it
    assert len(as_stored) >= 7, summary
    assert offline["k1_acceptance"] > 0.4, summary
    # the contract: vLLM accepts, prompt by prompt, what the draft predicts from our stored states
    # (measured on this 2-core machine, 2026-12-07: all 8 prompts the same in each of 6 runs,
    # 0.7676 both in three of them); one prompt may differ by a float32 near-tie of the draft
    assert abs(online - offline["k1_acceptance"]) <= 0.03, summary
    assert len(same) >= len(as_stored) - 1, summary
    # a slip of one layer shows: the shifted draft accepts on other positions, on prompts it too
    # answered as stored (measured with the trainer's seeds 0, 1, 2: 8 as stored, 5, 6, 5 differ;
    # the draft also reads the tokens of the answers it learned by heart, so not all do, and its
    # rate may come out near the right one's: 0.7431 against 0.75 with seed 1)
    assert len(shifted_differ) >= 3, summary

    # a report made again by hand, with none of the training's arguments, still states what
    # trained the drafts (the second GPU run's rows once said lr 3e-4, the report's default)
    report = [sys.executable, "-m", "job.benchmarks.acceptance", "report", "--work", str(work)]
    again = subprocess.run(
        [*report, "--results", str(rows)], env=env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    written = [json.loads(line) for line in rows.read_text().splitlines()]
    assert sorted(row["variant"] for row in written) == [
        "job_bf16",
        "job_bf16",
        "job_bf16_shifted_layers",
        "job_bf16_shifted_layers",
    ], written
    for row in written:
        assert row["draft"] == {"layers": 1, "vocab": 4096, "lr": 1e-3}, row
        assert (row["dtype"], row["k"], row["epochs"], row["train_prompts"]) == ("float32", 1, 25, 1), row
