"""The engine-agnostic API: what a serving stack calls on each side.

PrefillEndpoint (one per prefill worker / TP rank) and DecodeEndpoint (one per decode worker / TP rank)
wrap the sans-IO state machines with a background thread that owns the NIXL agent and the side channel.
Every engine-facing call only enqueues and returns: no descriptor work, no posting, no waiting.

    prefill = PrefillEndpoint(config, layout)        # layout placed in registered memory
    prefill.start()                                    # NIXL agent, side channel on config.host:port+rank
    prefill.prefill_done(req_id, block_ids, num_tokens)
    for r in prefill.finished(): free(r.block_ids)     # WRITE completed (or request failed)

    decode = DecodeEndpoint(config, layout)
    decode.start()
    decode.expect(req_id, block_ids, num_tokens, PrefillAddress(engine_id, host, port, tp_size))
    for r in decode.finished(): r.ok and start_decoding(r.request_id)

(Signatures fixed; the implementation lands with the runtime.)
"""
