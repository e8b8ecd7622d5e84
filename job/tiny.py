"""Tiny random models with a real tokenizer and chat template, built locally.

They stand in for a target model wherever no weights may be downloaded: the
embedded default run, the tests, the GPU smoke runs. Built once per cache
directory; the build is deterministic (fixed seed, fixed training text).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

BUILTIN_PREFIX = "builtin:"


def _jinja(text: str) -> str:
    """A template written over several lines, joined into one: every newline its
    output holds is a ``\\n`` inside a string literal, so the layout adds none."""
    return "".join(line.strip() for line in text.splitlines())


# Llama-3 headers; tool use as Llama 3.1 renders it (tools in an "Environment: ipython"
# system block, a call as {"name": ..., "parameters": ...}, results under the ipython
# role). Plain conversations render exactly as a Llama-3 template without tools does.
LLAMA3_TEMPLATE = _jinja(
    r"""
    {{- bos_token }}
    {%- if tools %}
        {{- '<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n' }}
        {{- 'To call a function, respond with JSON: {"name": function name, "parameters": arguments}.\n\n' }}
        {%- for tool in tools %}{{- tool | tojson + '\n\n' }}{%- endfor %}
        {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] | trim }}{%- endif %}
        {{- '<|eot_id|>' }}
    {%- endif %}
    {%- for message in messages %}
        {%- if tools and loop.first and message['role'] == 'system' %}
        {%- elif message['role'] == 'assistant' %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
            {% generation %}
            {%- if message['content'] %}{{- message['content'] | trim }}{%- endif %}
            {%- for call in message['tool_calls'] or [] %}
                {{- '{"name": "' + call['function']['name'] + '", "parameters": ' }}
                {{- call['function']['arguments'] | tojson + '}' }}
            {%- endfor %}
            {{- '<|eot_id|>' }}
            {% endgeneration %}
        {%- elif message['role'] == 'tool' %}
            {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
            {{- message['content'] | trim + '<|eot_id|>' }}
        {%- else %}
            {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
            {{- message['content'] | trim + '<|eot_id|>' }}
        {%- endif %}
    {%- endfor %}
    {%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
    """
)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The shape of Qwen3's template: tools in the system turn, <tool_call> JSON in assistant
# turns, consecutive tool results in one user turn as <tool_response>s, and reasoning
# (reasoning_content, or a <think> block in the content) rendered only for assistant
# turns after the last user message: always (if empty) for the final one, for the others
# only when they have some.
QWEN3_TEMPLATE = _jinja(
    r"""
    {%- if tools %}
        {{- '<|im_start|>system\n' }}
        {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}
        {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
        {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
        {%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
        {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
        {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
        {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
    {%- elif messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- endif %}
    {%- set ns = namespace(last_query=messages | length - 1) %}
    {%- for message in messages %}
        {%- if message['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
    {%- endfor %}
    {%- for message in messages %}
        {%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}
            {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
        {%- elif message['role'] == 'assistant' %}
            {%- set content = message['content'] if message['content'] is string else '' %}
            {%- set reasoning = message['reasoning_content'] %}
            {%- set reasoning = reasoning if reasoning is string else '' %}
            {%- if not reasoning and '</think>' in content %}
                {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
            {{- '<|im_start|>assistant\n' }}
            {% generation %}
            {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
                {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- content }}
            {%- endif %}
            {%- for call in message['tool_calls'] or [] %}
                {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
                {{- '<tool_call>\n{"name": "' + call['function']['name'] + '", "arguments": ' }}
                {{- call['function']['arguments'] | tojson + '}\n</tool_call>' }}
            {%- endfor %}
            {{- '<|im_end|>' }}
            {% endgeneration %}
            {{- '\n' }}
        {%- elif message['role'] == 'tool' %}
            {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
                {{- '<|im_start|>user' }}
            {%- endif %}
            {{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
            {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
                {{- '<|im_end|>\n' }}
            {%- endif %}
        {%- endif %}
    {%- endfor %}
    {%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
    """
)

_MARKER = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")


def strip_generation_markers(template: str) -> str:
    """The same template as most released models ship it: without generation markers."""
    return _MARKER.sub("", template)


SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<pad>",
]

_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Speculative decoding drafts tokens with a small model and verifies them with the target.",
    "EAGLE-3 fuses low, mid and high level features of the target model's hidden states.",
    "def prefill(tokens): return model(tokens).hidden_states  # Python 0123456789",
    "Paris is the capital of France; Berlin is the capital of Germany; Tokyo of Japan.",
    "Grüße aus Zürich! Ça va? ¿Qué tal? Привет, как дела? こんにちは世界。 你好，世界！ 🚀✨",
    "system user assistant: You are a helpful assistant. Answer briefly and precisely.",
    "Shards hold many samples; the manifest is written last; resume happens exactly once.",
]

# Qwen3's reasoning and tool-call markup: single tokens in its vocabulary, as here.
QWEN3_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# name -> (architecture, chat template, eos token, tokens added to SPECIAL_TOKENS)
BUILTIN_MODELS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "tiny-llama": ("llama", LLAMA3_TEMPLATE, "<|eot_id|>", ()),
    "tiny-chatml": ("llama", CHATML_TEMPLATE, "<|im_end|>", ()),
    "tiny-deepseek-v3": ("deepseek_v3", CHATML_TEMPLATE, "<|im_end|>", ()),
    "tiny-qwen3": ("qwen3", QWEN3_TEMPLATE, "<|im_end|>", QWEN3_TOKENS),
}
_BUILD_VERSION = "4"


def cache_root() -> Path:
    base = os.environ.get("JOB_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "eagle3-extract"
    )
    return Path(base)


def builtin_model_dir(name: str) -> Path:
    """Return the directory of builtin model ``name``, building it on first use."""
    if name not in BUILTIN_MODELS:
        raise KeyError(name)
    import transformers

    arch, template, eos, extra_tokens = BUILTIN_MODELS[name]
    # Tokenizer files saved by transformers 5 do not load in 4.x: one build per major version.
    major = transformers.__version__.split(".")[0]
    recipe = f"{_BUILD_VERSION}|{name}|{arch}|{template}|{eos}|{major}"
    if extra_tokens:
        recipe += "|" + "|".join(extra_tokens)
    key = hashlib.sha256(recipe.encode()).hexdigest()
    target = cache_root() / f"{name}-{key[:12]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _build(staging, arch, template, eos, extra_tokens)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build_tokenizer(out: Path, template: str, eos: str, extra_tokens: tuple[str, ...]) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=[*SPECIAL_TOKENS, *extra_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING_TEXT * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token=eos,
        pad_token="<pad>",
    )
    fast.chat_template = template
    fast.save_pretrained(out)
    return len(fast)


def _build(out: Path, arch: str, template: str, eos: str, extra_tokens: tuple[str, ...]) -> None:
    import torch
    from transformers import AutoTokenizer

    vocab_used = _build_tokenizer(out, template, eos, extra_tokens)
    tokenizer = AutoTokenizer.from_pretrained(out)
    vocab = 1024
    assert vocab_used <= vocab
    common = dict(
        vocab_size=vocab,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    if arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=8,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            **common,
        )
        model = Qwen3ForCausalLM(config)
    elif arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=8,
            num_attention_heads=2,  # head_dim 64: the smallest vLLM's CPU attention accepts
            num_key_value_heads=1,
            **common,
        )
        model = LlamaForCausalLM(config)
    else:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config = DeepseekV3Config(
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=2,
            num_key_value_heads=2,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            # As in DeepSeek-V3's own config; HF always routes this way, vLLM only when told.
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            # MLA with DeepSeek-V3's own latent sizes: kernels are specialised for them
            kv_lora_rank=512,
            q_lora_rank=128,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            rope_scaling=None,
            **common,
        )
        model = DeepseekV3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
