"""The servers' listening socket (kvtransfer.serve.http.port_socket)."""

from __future__ import annotations

import asyncio
import socket

from kvtransfer.serve.http import free_port, port_socket


def test_connections_to_a_server_socket_send_without_nagle():
    """uvicorn serves on the socket through asyncio, which turns Nagle off (TCP_NODELAY) only on
    the connections of a socket made for IPPROTO_TCP; with Nagle on, a stream's first chunk
    after its headers waited for the client's delayed ACK."""
    async def main() -> int:
        sock = port_socket("127.0.0.1", free_port(), "port")
        accepted = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(
            lambda r, w: accepted.set_result(w.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP,
                                                                                   socket.TCP_NODELAY)), sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            try:
                return await asyncio.wait_for(accepted, 30.0)
            finally:
                writer.close()

    assert asyncio.run(main()) != 0

