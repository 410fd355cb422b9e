"""The push protocol, sans-IO: messages, layouts, plans, TP mapping, handshake and the two state machines.

Nothing here imports a socket, a thread or NIXL; only this package and kvpush.errors (a test enforces it).
"""
