"""Ferry: a Llumnix-style load balancer for OpenAI-compatible LLM servers."""

__version__ = "0.1.0"
