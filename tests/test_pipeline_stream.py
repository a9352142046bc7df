"""stream.FrameReader: frames cut out of the stream in the data callback, in order, however the
bytes are chunked; a bad frame, the end of the stream or a failing handler ends dispatch."""
from __future__ import annotations

import asyncio

import pytest

from flotilla.runtime.pipeline.stream import FrameReader, open_connection, start_server
from flotilla.runtime.pipeline.wire import ProtocolError, frame

BODIES = [b"a", b"", b"x" * 70_000, b"hello", b"z" * 3]


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("chunk", [1, 3, 7, 4096, 1 << 20])
def test_frames_in_order_however_chunked(chunk):
    async def main():
        reader = FrameReader(1 << 16, asyncio.get_running_loop())
        reader.feed_data(frame(BODIES[0]))  # before dispatch: buffered, handed out when it starts
        got = []
        done = reader.dispatch(got.append, 1 << 20)
        data = b"".join(frame(b) for b in BODIES[1:])
        for i in range(0, len(data), chunk):
            reader.feed_data(data[i:i + chunk])
        assert got == BODIES and not done.done()
        reader.feed_data(b"\0\0")  # half a header, then the end
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await done

    run(main())


def test_oversized_frame_and_failing_handler_end_dispatch():
    async def main():
        loop = asyncio.get_running_loop()
        reader = FrameReader(1 << 16, loop)
        got = []
        done = reader.dispatch(got.append, 10)
        reader.feed_data(frame(b"ok") + frame(b"y" * 11) + frame(b"never"))
        assert got == [b"ok"]
        with pytest.raises(ProtocolError, match="exceeds the limit"):
            await done

        reader = FrameReader(1 << 16, loop)

        def handle(body):
            raise ProtocolError(f"unexpected {body!r}")

        done = reader.dispatch(handle, 100)
        reader.feed_data(frame(b"bad") + frame(b"next"))
        with pytest.raises(ProtocolError, match="unexpected b'bad'"):
            await done

    run(main())


def test_over_a_socket():
    async def main():
        served = asyncio.get_running_loop().create_future()

        async def on_conn(reader, writer):
            await reader.readexactly(2)  # a plain read first, as the handshake does
            got = []
            try:
                await reader.dispatch(got.append, 1 << 20)
            except asyncio.IncompleteReadError:
                served.set_result(got)

        srv = await start_server(on_conn, "127.0.0.1", 0, 1 << 16)
        reader, writer = await open_connection("127.0.0.1", srv.sockets[0].getsockname()[1], 1 << 16)
        writer.write(b"hi" + b"".join(frame(b) for b in BODIES))
        await writer.drain()
        writer.close()
        assert await asyncio.wait_for(served, 10) == BODIES
        srv.close()

    run(main())


def test_direct_writes_from_a_thread_keep_frames_whole_and_in_sequence():
    """Connection.write_direct from another thread, mixed with the loop's own writes and with
    frames big enough to fill the socket: every frame arrives whole, its MAC checks out under
    its sequence number, and each side's order is kept."""
    from test_pipeline_wire import TOKEN, _pair

    from flotilla.runtime.pipeline.connection import Hello

    async def main():
        srv, (server, _), client = await _pair(TOKEN, TOKEN, max_frame=1 << 20)
        client.allow_direct()
        loop = asyncio.get_running_loop()
        got: list = []
        done = asyncio.ensure_future(server.serve(got.append))

        def thread_side():
            for i in range(300):
                msg = Hello(i, b"t" * (i * 997 % 200_000), "thread")
                assert client.write_direct(msg)

        sender = loop.run_in_executor(None, thread_side)
        for i in range(300):
            client.write(Hello(i, b"", "loop"))
            await asyncio.sleep(0)
        await sender
        while len(got) < 600:
            await asyncio.sleep(0.01)
        for who in ("thread", "loop"):
            assert [m.version for m in got if m.name == who] == list(range(300))
        assert server.bytes_received == client.bytes_sent
        client.close()
        with pytest.raises(asyncio.IncompleteReadError):
            await asyncio.wait_for(done, 10)
        srv.close()

    run(main())
