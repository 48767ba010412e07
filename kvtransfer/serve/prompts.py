"""A request's prompt as token ids, and how many tokens it may generate, on a node.

:func:`prompt_ids` renders a chat through the model's template and encodes it; a text too long
for the pool on its bytes alone (each token stands for at most ``max_token_bytes`` of them) is
refused before the tokenizer spends seconds on it. The node calls it in a thread: the
tokenizer releases the GIL, so a long prompt does not stall the node's event loop.
:func:`token_budget` is ``max_tokens``, or by default what the pool and the context leave after
the prompt (vLLM's rule). Both raise :class:`ApiError` (400 ``context_length_exceeded``, the
field at fault in ``param``) for a request that cannot fit.
"""

from __future__ import annotations

import numpy as np

from kvtransfer.models.engine import check_request, token_capacity
from kvtransfer.serve.openai_api import ApiError, ChatRequest

__all__ = ["prompt_ids", "token_budget"]


def _prompt_field(req) -> str:
    return "messages" if isinstance(req, ChatRequest) else "prompt"


def prompt_ids(req, tokenizer, ec, model_config) -> np.ndarray:
    """The request's prompt (chat: through the template) as token ids, an int32 array: it
    crosses to the ranks as one buffer, and the engine checks it in one pass."""
    if isinstance(req, ChatRequest):
        text = tokenizer.apply_chat_template([msg.for_template() for msg in req.messages])
    else:
        text = req.prompt
    capacity = token_capacity(ec, model_config)
    size = len(text.encode("utf-8"))
    fewest = -(-size // tokenizer.max_token_bytes)
    if fewest > capacity:
        raise ApiError(400, f"the prompt's {size} bytes make at least {fewest} tokens, more than the {capacity} "
                            f"token slots a request may hold", _prompt_field(req), "context_length_exceeded")
    return np.asarray(tokenizer.encode(text), dtype=np.int32)


def token_budget(req, ids, role: str, ec, model_config) -> int:
    """``max_tokens``, or what the pool and the context leave after the prompt; a prefill node
    only checks that the prompt and its first token fit."""
    capacity = token_capacity(ec, model_config)
    budget = req.new_tokens(max(1, capacity - len(ids)))
    try:
        check_request(ids, 1 if role == "prefill" else budget, ec, model_config)
    except ValueError as exc:
        if len(ids) >= capacity:
            raise ApiError(400, str(exc), _prompt_field(req), "context_length_exceeded") from None
        if len(ids) + budget > capacity:
            raise ApiError(400, str(exc), "max_tokens", "context_length_exceeded") from None
        raise ApiError(400, str(exc)) from None
    return budget
