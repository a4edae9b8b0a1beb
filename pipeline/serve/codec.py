"""Text and chat messages to token ids and back, with the tokenizer of the model `pipe serve`
serves; a prompt the routes cannot use is an `APIError` naming the field at fault."""

from __future__ import annotations

import functools

from pipeline.serve.openai_api import APIError, chat_prompt, template_messages


class Codec:
    """The served model's tokenizer and chat template, as the routes use them."""

    def __init__(self, tokenizer, chat_template, vocab_size: int) -> None:
        self.tokenizer, self.template, self.vocab_size = tokenizer, chat_template, vocab_size
        # logprobs name each token by its text, the same few tokens over and over
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`."""
        return self.tokenizer.encode_batch([text])[0]

    def decode(self, ids: list[int]) -> str:
        """The text of token ids."""
        return self.tokenizer.decode(ids)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def prompt(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """A prompt's token ids: a text encoded, or ids checked against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise APIError("the prompt is empty", param=param)
            return self.encode(prompt)
        bad = [t for t in prompt if t >= self.vocab_size]
        if bad:
            limit = self.vocab_size - 1
            raise APIError(f"token id {bad[0]} is out of the vocabulary (0..{limit})", param=param)
        return list(prompt)

    def chat(self, messages, add_generation_prompt: bool = True) -> str:
        """The chat prompt text (a template's own error is a 400 naming it)."""
        plain = template_messages(messages, self.template)
        try:
            return chat_prompt(plain, self.template, add_generation_prompt)
        except Exception as error:  # noqa: BLE001 - a template's own error, reported as such
            raise APIError(f"chat template: {error}", param="messages") from None
