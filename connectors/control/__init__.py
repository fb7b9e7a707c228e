"""Control messages between kvwire processes: zmq sockets, framing, authentication, side channels."""
