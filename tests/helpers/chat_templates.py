"""A corpus of chat-template behaviours: small tokenizer + template fixtures, one per model family.

Each fixture reproduces the documented rules of one family's chat template (written here from the
families' published templates, reduced to what changes rendering) on a real byte-level BPE
tokenizer trained in-process on a small corpus, with the family's special tokens and BOS
behaviour. Nothing is downloaded.

| family    | rules reproduced                                                                      |
|-----------|---------------------------------------------------------------------------------------|
| chatml    | SmolLM2 / Qwen2.5 ChatML: a default system prompt injected when none is given          |
| qwen3     | Qwen3: an empty reasoning block ``<think>\\n\\n</think>\\n\\n`` before the content of the |
|           | last assistant turn after the last user query; the content's leading newlines dropped   |
| llama3    | Llama-3.1 headers, ``bos_token`` written by the template and added by the tokenizer,   |
|           | a date system turn always rendered, content trimmed, ``tool`` rendered as ``ipython``   |
| llama2    | Llama-2 / Mistral ``[INST]``: roles must alternate user/assistant (raise_exception),    |
|           | the system message folded into the first user turn in ``<<SYS>>``, content stripped,   |
|           | the answer written as ``' ' + content + ' ' + eos``                                     |
| llama2-   | the same, with Llama-2-chat's original default system prompt written in ``<<SYS>>``   |
| default   | when the conversation has no system message                                           |
| gemma     | Gemma: no system role (raise), ``model`` for assistant, alternation enforced, trimmed   |
| phi3      | Phi-3: ``<|user|>``/``<|assistant|>``/``<|end|>``, eos after the last turn, tool role   |
|           | not rendered                                                                          |
| trim      | a zephyr-style template that strips whitespace from every message's content            |
| tools     | Qwen2.5 with native ``tool_calls`` (Hermes ``<tool_call>`` blocks) and ``tool`` results |
|           | rendered as ``<tool_response>`` inside a user turn                                     |

Templates that write today's date (:data:`DATED_FAMILIES`, not in :data:`FAMILIES`: their text
changes with the day):

| family        | rules reproduced                                                                  |
|---------------|-----------------------------------------------------------------------------------|
| llama31_date  | Llama 3.1 headers with ``Today Date: {{ strftime_now("%d %b %Y") }}`` in the system |
|               | turn                                                                              |
| llama32_date  | Llama 3.2: ``date_string`` used when defined, else ``strftime_now("%d %b %Y")``,   |
|               | else ``26 Jul 2024``                                                              |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

QWEN3 = (
    "{%- set ns = namespace(last_query_index=messages|length - 1, found=false) -%}"
    "{%- for message in messages[::-1] -%}"
    "{%- if not ns.found and message.role == 'user' -%}"
    "{%- set ns.found = true -%}{%- set ns.last_query_index = (messages|length - 1) - loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- if loop.index0 > ns.last_query_index and loop.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content.lstrip('\\n') + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_LLAMA3_TURNS = (
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
_LLAMA3_SYSTEM = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
)

LLAMA31_DATE = (
    "{{- bos_token }}" + _LLAMA3_SYSTEM + "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}" + _LLAMA3_TURNS
)
"""Llama 3.1's shape, the date written by transformers' ``strftime_now`` helper."""

LLAMA32_DATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}{%- endif %}"
    + _LLAMA3_SYSTEM
    + "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}" + _LLAMA3_TURNS
)
"""Llama 3.2's shape: the ``date_string`` variable when the caller defines it."""

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

LLAMA2_DEFAULT = LLAMA2.replace(
    "{% set system_message = false %}",
    "{% set system_message = 'You are a helpful, respectful and honest assistant. Always answer as helpfully as possible.' %}",
)
"""Llama-2-chat as first published (``use_default_system_prompt``): the default system prompt
in ``<<SYS>>`` when the conversation has no system message."""

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
"""Mistral-7B-Instruct v0.1: ``[INST]`` turns, no system role (a system message breaks the
alternation and is refused), nothing injected. Used with the ``llama2`` family's tokenizer."""

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

PHI3 = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

TRIM = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

TOOLS = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Family:
    """One template family.

    Attributes:
        name: the family.
        template: its chat template (Jinja).
        bos: the BOS token, or None.
        eos: the EOS token.
        prepends_bos: whether the tokenizer adds BOS to every encoding (its post-processor).
        specials: further special tokens (end-of-turn markers, headers).
        added: added tokens that are not special (Qwen3's ``<think>``).
        end_of_turn: the special token that ends the answer's turn (scored with the answer).
        scored: how the scored tokens decode, as a format of the answer (written from the template).
        inserted: the template text between the generation prompt and the answer's content.
        alternates: the template refuses roles that do not alternate user/assistant.
        system: whether the template accepts a system message.
    """

    name: str
    template: str
    eos: str
    bos: str | None = None
    prepends_bos: bool = False
    specials: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    scored: str = "{answer}{eot}"
    end_of_turn: str = ""
    inserted: str = ""
    alternates: bool = False
    system: bool = True
    native_tools: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


FAMILIES = (
    Family(name="chatml", template=CHATML, eos="<|im_end|>", bos="<|im_start|>", specials=("<|im_start|>",), end_of_turn="<|im_end|>"),
    Family(
        name="qwen3",
        template=QWEN3,
        eos="<|im_end|>",
        specials=("<|im_start|>", "<|endoftext|>"),
        added=("<think>", "</think>"),
        end_of_turn="<|im_end|>",
        inserted="<think>\n\n</think>\n\n",
    ),
    Family(
        name="llama3",
        template=LLAMA3,
        eos="<|eot_id|>",
        bos="<|begin_of_text|>",
        prepends_bos=True,
        specials=("<|start_header_id|>", "<|end_header_id|>"),
        end_of_turn="<|eot_id|>",
    ),
    Family(
        name="llama2",
        template=LLAMA2,
        eos="</s>",
        bos="<s>",
        prepends_bos=True,
        end_of_turn="</s>",
        scored=" {answer} {eot}",
        inserted=" ",
        alternates=True,
    ),
    Family(
        name="llama2-default",
        template=LLAMA2_DEFAULT,
        eos="</s>",
        bos="<s>",
        prepends_bos=True,
        end_of_turn="</s>",
        scored=" {answer} {eot}",
        inserted=" ",
        alternates=True,
    ),
    Family(
        name="gemma",
        template=GEMMA,
        eos="<eos>",
        bos="<bos>",
        prepends_bos=True,
        specials=("<start_of_turn>", "<end_of_turn>"),
        end_of_turn="<end_of_turn>",
        alternates=True,
        system=False,
    ),
    Family(
        name="phi3",
        template=PHI3,
        eos="<|endoftext|>",
        bos="<s>",
        prepends_bos=True,
        specials=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        end_of_turn="<|end|>",
    ),
    Family(name="trim", template=TRIM, eos="</s>", bos="<s>", prepends_bos=True, end_of_turn="</s>"),
    Family(
        name="tools",
        template=TOOLS,
        eos="<|im_end|>",
        specials=("<|im_start|>", "<|endoftext|>"),
        end_of_turn="<|im_end|>",
        native_tools=True,
    ),
)
"""The corpus, by family."""

_LLAMA3_TOKENS: dict[str, Any] = dict(
    eos="<|eot_id|>",
    bos="<|begin_of_text|>",
    prepends_bos=True,
    specials=("<|start_header_id|>", "<|end_header_id|>"),
    end_of_turn="<|eot_id|>",
)
DATED_FAMILIES = (
    Family(name="llama31_date", template=LLAMA31_DATE, **_LLAMA3_TOKENS),
    Family(name="llama32_date", template=LLAMA32_DATE, **_LLAMA3_TOKENS),
)
"""Templates that write today's date (module docs)."""

CORPUS = [
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
    "It is a wrought-iron lattice tower. It was designed by Gustave Eiffel's company.",
    "Some facts: - It is 330 m tall. - It was completed in 1889. When was it completed?",
    "You answer questions about landmarks. Keep answers short. Tell me about the Eiffel Tower.",
    "system user assistant model tool ipython get_weather city Paris temperature sunny",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} <tool_call> </tool_call> <tool_response>',
    "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024 [INST] [/INST] <<SYS>> <</SYS>>",
] * 4


def family_named(name: str) -> Family:
    """The family of :data:`FAMILIES` or :data:`DATED_FAMILIES` called ``name``."""
    return next(f for f in (*FAMILIES, *DATED_FAMILIES) if f.name == name)


def build_family_tokenizer(family: Family):
    """A real fast tokenizer (byte-level BPE trained on :data:`CORPUS`) with the family's
    special tokens, BOS behaviour and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", family.eos, *([family.bos] if family.bos else []), *family.specials]
    if family.end_of_turn and family.end_of_turn not in specials:
        specials.append(family.end_of_turn)
    specials = list(dict.fromkeys(specials))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if family.prepends_bos:
        bos_id = tok.token_to_id(family.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B", special_tokens=[(family.bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    extra = [t for t in specials if t not in ("<pad>", family.eos, family.bos)]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=family.eos,
        bos_token=family.bos,
        pad_token="<pad>",
        additional_special_tokens=extra,
    )
    if family.added:
        fast.add_tokens(list(family.added))
    fast.chat_template = family.template
    return fast


def conversation(family: Family, *, tools: bool = False) -> dict[str, Any]:
    """A multi-turn chat with line breaks, a Markdown list and (``tools``) a tool exchange, in
    the OpenAI format (tool calls native)."""
    messages: list[dict[str, Any]] = []
    if family.system:
        messages.append({"role": "system", "content": "You answer questions about landmarks.\nKeep answers short."})
    messages += [
        {"role": "user", "content": "Tell me about the Eiffel Tower."},
        {"role": "assistant", "content": "It is a wrought-iron lattice tower.\n\nIt was designed by Gustave Eiffel's company."},
    ]
    if tools:
        messages += [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
            {"role": "assistant", "content": "It is sunny in Paris."},
        ]
    messages += [
        {"role": "user", "content": "Some facts:\n- It is 330 m tall.\n- It was completed in 1889.\n\nWhen was it completed?"},
        {"role": "assistant", "content": "It was completed in 1889."},
    ]
    return {"messages": messages}
