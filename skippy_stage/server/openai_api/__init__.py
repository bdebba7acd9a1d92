"""The OpenAI-compatible HTTP API at the head: /v1/models, /v1/completions, /v1/chat/completions.

It runs beside the gRPC server, in the same process: uvicorn serves a starlette app on its
own thread and event loop (``http_server``, ``app``). Every generation takes the gRPC
``Generate`` path — the servicer's Generator (``StageServicer.head``), whose blocking iterator
is driven on a worker thread of its own and handed to the event loop through a queue
(``generation``). A client that goes away (disconnect, closed stream) cancels its generation,
which frees the session on every stage.

A request body is checked field by field (``request``), and domain errors become HTTP
statuses in one place (``http_errors``). ``endpoint`` answers a completion or chat completion
request: one JSON body, or server-sent events as the tokens come. ``tools`` holds tool calling:
the tools and tool turns checked, rendered for the chat template, the calls' grammar, and the calls
read out of generated text.

Beside it, on the same app and generation path: Anthropic's Messages API, /v1/messages
(``anthropic_request`` checks a body, ``anthropic_messages`` answers in Anthropic's shapes and
events), OpenAI's Responses API, /v1/responses (``responses_request`` checks a body and turns it
into a chat completion's, ``responses_api`` answers with Response objects and events and keeps the
stored responses), and llama-server's /tokenize, /detokenize and /props (``llama_server``).
"""
