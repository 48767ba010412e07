"""Serving: prefill, decode and colocated nodes over HTTP, and the OpenAI-compatible router.

``node`` (``kvtransfer serve``) is a node's HTTP process; ``worker`` one of its TP rank
processes; ``router`` (``kvtransfer router``) pairs each request with a prefill and a decode
node; ``openai_api`` holds the OpenAI request/response shapes and errors, ``prompts`` a
request's token ids and budget, ``http`` what nodes and router share over HTTP, ``metrics`` the
Prometheus metrics, ``messages`` what a node and its ranks say to each other.
"""
