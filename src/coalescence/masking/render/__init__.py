"""From coalition to token ids: chat template rendering and teacher-forcing targets.

Scoring (teacher forcing). The answer is located by character offsets in the *full* rendering
(the prompt messages plus the answer as the last assistant turn, rendered by the model's own chat
template): the scored tokens are the tokens that overlap the answer's content, through the
template's end-of-turn token (the decision to stop is part of the answer); template text after
that token is not scored. Whatever the template writes between the assistant header and the
answer's content (Qwen3's empty reasoning block ``<think>\\n\\n</think>\\n\\n``, the space after
Llama-2's ``[/INST]``) is prompt: conditioned on, never scored, and recorded
(:attr:`TargetTokens.inserted`). Every coalition is rendered the same way, its masked messages plus
the answer, and its prompt is that text up to the answer's first scored token, so the template
treats each coalition as it treats the original, and every coalition is scored on the same ids.

Generation (a target to generate, regenerate-and-compare utilities) uses the generation prompt
(the messages and the assistant header, ``add_generation_prompt=True``).

A generated answer (the snapshot's :attr:`~coalescence.conversation.Conversation.target_ids`) is
scored as the ids the model produced, never decoded and encoded again (decode-then-encode is not
the identity: a byte-level token cut inside a UTF-8 character decodes to U+FFFD, a leading-space
token is merged or stripped). The rule: every coalition's prompt is its *generation prompt*
(what the model generated the answer after), and the target is the generated ids (the stop token
the model ended with excluded) followed by the template's end-of-turn, the tokens the template
writes after an answer's content up to and including its first special token (whitespace before
it included, as for a text answer). The assistant turn's content in the full rendering is the
ids' decoded text (special tokens kept), which is what is shown and what answer sub-spans count
characters in; nothing is located by it. Nothing the template writes between the assistant header
and an answer's content in a full rendering (Qwen3's empty reasoning block) is then in the
prompt: the model generated after the header.

The package, one concern a module (every name is imported from here, as before the split):

- :mod:`.renderer`: :class:`ChatRenderer`, the template applied (a template that refuses a
  conversation, or does not render the answer verbatim, raises
  :class:`~coalescence.errors.TemplateRefused` quoting its message);
- :mod:`.spans`: rendered text that remembers where content spells a special token;
- :mod:`.dates`: the date a template writes, pinned per renderer (:data:`TODAY_ENV`,
  :func:`template_now`);
- :mod:`.target`: :class:`TargetTokens`, the ids scored and where they are;
- :mod:`.probes`: what a template does (a default system prompt, the date), found by rendering;
- :mod:`.tokenizing`: ids with exactly one BOS, special-token text in content encoded as text;
- :mod:`.locate`: the answer located in the full rendering, and each coalition's scoring prompt.
"""

from __future__ import annotations

from .dates import TODAY_ENV, template_now
from .renderer import ChatRenderer
from .spans import RenderedText
from .target import TargetTokens

__all__ = ("TODAY_ENV", "ChatRenderer", "RenderedText", "TargetTokens", "template_now")
