"""Text and chat messages to token ids and back, with the tokenizer of the model `pipe serve`
serves; a prompt the routes cannot use is an `APIError` naming the field at fault."""

from __future__ import annotations

import functools
from typing import Any

from pipeline.serve.http.openai_api import APIError, chat_prompt, template_messages


class Codec:
    """The served model's tokenizer and chat template, as the routes use them; `path` (where the
    tokenizer was loaded from) gives the copy that adds special tokens, loaded when first asked."""

    def __init__(self, tokenizer, chat_template, vocab_size: int, path: str | None = None) -> None:
        self.tokenizer, self.template, self.vocab_size = tokenizer, chat_template, vocab_size
        self.path, self._special = path, None
        # logprobs name each token by its text, the same few tokens over and over
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The token ids of `text`; with `add_special_tokens`, the tokenizer's own (e.g. a BOS)
        added as its post-processor says."""
        tokenizer = self._with_special_tokens() if add_special_tokens else self.tokenizer
        return tokenizer.encode_batch([text])[0]

    def _with_special_tokens(self):
        if self._special is None:
            from pipeline.tokenizer.tokenizer import load_tokenizer

            with_special = self.path is not None
            self._special = (
                load_tokenizer(self.path, add_special_tokens=True)
                if with_special
                else self.tokenizer
            )
        return self._special

    def decode(self, ids: list[int]) -> str:
        """The text of token ids."""
        return self.tokenizer.decode(ids)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def prompt(
        self, prompt: str | list[int], param: str = "prompt", special_tokens: bool = False
    ) -> list[int]:
        """A prompt's token ids: a text encoded (with the tokenizer's own special tokens when
        `special_tokens`), or ids checked against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise APIError("the prompt is empty", param=param)
            return self.encode(prompt, special_tokens)
        bad = [t for t in prompt if t >= self.vocab_size]
        if bad:
            limit = self.vocab_size - 1
            raise APIError(f"token id {bad[0]} is out of the vocabulary (0..{limit})", param=param)
        return list(prompt)

    def chat(
        self,
        messages,
        add_generation_prompt: bool = True,
        *,
        continue_final: bool = False,
        tools: list | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The chat prompt text (a template's own error is a 400 naming it). `continue_final`
        ends it at the last message's text, left open for the model to continue (as
        transformers' `continue_final_message`); `tools` and `extra` go to the template."""
        plain = template_messages(messages, self.template)
        try:
            if self.template is None:
                text = chat_prompt(plain, None, add_generation_prompt)
            else:
                rendered = self.template.render(
                    plain,
                    add_generation_prompt=add_generation_prompt,
                    tools=tools,
                    **(extra or {}),
                )
                text = rendered.text
        except Exception as error:  # noqa: BLE001 - a template's own error, reported as such
            raise APIError(f"chat template: {error}", param="messages") from None
        return _open_final(text, plain[-1]["content"]) if continue_final else text


def _open_final(text: str, final: str) -> str:
    """`text` cut right after the last occurrence of the final message `final` (the template's
    end-of-turn dropped), as transformers' `continue_final_message` cuts it: `final` with its
    trailing spaces when the template kept them, else without."""
    stripped = final.strip()
    at = text.rfind(stripped) if stripped else -1
    if at < 0:
        raise APIError(
            "continue_final_message: the last message's text is not in the rendered chat",
            param="continue_final_message",
        )
    kept = final.lstrip()
    return text[: at + (len(kept) if text[at : at + len(kept)] == kept else len(stripped))]
