"""Two byte-for-byte TCP forwarders on loopback that put idempotent-proxy in front of the counting
service (bench/conformance/README.md):

  forward.py tls PORT TARGET CERT KEY
      Accepts TLS on 127.0.0.1:PORT (CERT, KEY) and pipes each connection, decrypted, to the plain
      TARGET (host:port). idempotent-proxy forwards only to https://<X-Forwarded-Host><path>; this
      puts the counting service, which speaks plain HTTP, behind a certificate the proxy is told to
      trust (SSL_CERT_FILE).

  forward.py route PORT COUNTS TARGET
      Accepts on 127.0.0.1:PORT and pipes each connection to TARGET (the proxy), unless its first
      line is `GET /count/...`: then to COUNTS (the counting service itself). idempotent-proxy
      refuses any request without an Idempotency-Key (400), and the suite reads the counts without
      one. The suite opens a new connection per request, so the first line decides for the whole
      request; nothing of either is changed.
"""

import asyncio
import ssl
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError, OSError):
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
            else:
                writer.close()
        except (OSError, RuntimeError):
            pass


async def splice(client_reader, client_writer, target: str, first: bytes = b"") -> None:
    host, port = target.rsplit(":", 1)
    try:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
    except OSError:
        client_writer.close()
        return
    if first:
        up_writer.write(first)
    await asyncio.gather(pipe(client_reader, up_writer), pipe(up_reader, client_writer))
    for writer in (up_writer, client_writer):
        writer.close()


async def tls(port: str, target: str, cert: str, key: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["http/1.1"])

    async def serve(reader, writer):
        await splice(reader, writer, target)

    server = await asyncio.start_server(serve, "127.0.0.1", int(port), ssl=context)
    print(f"forward: https://127.0.0.1:{port} -> http://{target}", flush=True)
    async with server:
        await server.serve_forever()


async def route(port: str, counts: str, target: str) -> None:
    async def serve(reader, writer):
        try:
            first = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError as error:
            first = await reader.readexactly(error.consumed)
        except asyncio.IncompleteReadError as error:
            first = error.partial
        to = counts if first.startswith(b"GET /count/") else target
        await splice(reader, writer, to, first)

    server = await asyncio.start_server(serve, "127.0.0.1", int(port))
    print(f"forward: 127.0.0.1:{port} -> {target} (GET /count/... -> {counts})", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "tls" and len(args) == 4:
        asyncio.run(tls(*args))
    elif mode == "route" and len(args) == 3:
        asyncio.run(route(*args))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
