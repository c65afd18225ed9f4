"""``--chat-template``: which Jinja template ``/v1/chat/completions`` renders conversations with.

Without the flag the tokenizer's own template (``tokenizer_config.json`` ``chat_template``) is
used. With it, the value is either the path of a Jinja template file or the name of one of the
built-in templates below, and it replaces the tokenizer's template for every chat request.

The template is loaded and compiled when the server arguments are checked, so a missing file, a
name that is neither a file nor a built-in, or a template with a Jinja syntax error is a CLI error
naming the flag, before any process starts.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

# Built-in templates, by upstream SGLang's names for the same conversation formats. Each renders
# ``messages`` (role + content) and, with ``add_generation_prompt``, opens the assistant's turn.
BUILTIN_CHAT_TEMPLATES: Dict[str, str] = {
    # <|im_start|>role\ncontent<|im_end|> (Qwen, Ling, many others).
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Llama 3 instruct: header tokens around the role, <|eot_id|> after each turn.
    "llama-3-instruct": (
        "{{ bos_token or '' }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
        "message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
}


def load_chat_template(value: str) -> str:
    """The Jinja source ``--chat-template value`` stands for: the text of the file at ``value``,
    else the built-in template of that name. ``ValueError`` naming the flag otherwise."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"--chat-template must be a template file or a built-in template name, "
                         f"got {value!r}")
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot read the file: {e}") from e
        if not text.strip():
            raise ValueError(f"--chat-template {value}: the file is empty")
        return text
    if value in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[value]
    if os.path.isdir(value):
        raise ValueError(f"--chat-template {value} is a directory; give a Jinja template file")
    raise ValueError(
        f"--chat-template {value}: no such file, and not a built-in template name (built-in: "
        f"{', '.join(sorted(BUILTIN_CHAT_TEMPLATES))})")


def check_chat_template(value: str) -> str:
    """Load (see :func:`load_chat_template`) and compile the template; return its source.

    Compiled in a sandboxed Jinja environment, as ``transformers`` renders chat templates, so a
    syntax error surfaces here (with its line) rather than on the first chat request.
    """
    text = load_chat_template(value)
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {value}: invalid Jinja template (line {e.lineno}): "
                         f"{e.message}") from e
    return text


def apply_chat_template_override(tokenizer: Any, chat_template: Optional[str]) -> None:
    """Make ``tokenizer`` render chats with ``--chat-template`` (a no-op when the flag is unset).

    Raises ``ValueError`` when the flag is set but the model has no tokenizer: chat needs one to
    tokenize the rendered prompt, and silently ignoring the flag would hide the mistake.
    """
    if chat_template is None:
        return
    if tokenizer is None:
        raise ValueError(f"--chat-template {chat_template}: the model has no tokenizer, so there "
                         "is no chat to apply a template to")
    tokenizer.chat_template = load_chat_template(chat_template)
