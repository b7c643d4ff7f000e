"""The error a request that cannot run raises, naming the offending parameter as data.

Raised by ``SamplingParams`` validation and by the engine's input processing. Front ends map it
by its attributes (the HTTP server to an OpenAI error body's ``param`` and ``code``), never by
parsing the message, so a reworded message cannot change which parameter a client is told about.
At the bottom of the layers: it imports nothing.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot run here (a bad parameter, a prompt too long or malformed); the message says why.

    `param`: the parameter at fault, by its OpenAI / vLLM name ("temperature", "max_tokens",
    "prompt", "stop", "structured_outputs", ...), None when no single one is; `code`: the kind of
    failure in a word ("context_length_exceeded"), or None. A ValueError, so callers that catch
    those keep working; the attributes survive pickling (BaseException keeps the instance dict).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code

    def renamed(self, param: str | None) -> InvalidRequestError:
        """The same error under another name for its parameter (an endpoint's own, e.g. max_tokens ->
        max_completion_tokens), the message's leading name included."""
        message = str(self)
        if param is not None and self.param is not None and message.startswith(self.param):
            message = param + message[len(self.param):]
        return InvalidRequestError(message, param, self.code)
