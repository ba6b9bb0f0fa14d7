"""A TLS terminator on loopback: accepts TLS on 127.0.0.1:PORT (CERT, KEY) and pipes the bytes of each
connection, unchanged, to the plain-TCP TARGET (host:port).

idempotent-proxy forwards only to https://<X-Forwarded-Host><path>; this puts the counting service,
which speaks plain HTTP, behind a certificate the proxy is told to trust (SSL_CERT_FILE).

Usage: tls_forward.py PORT TARGET CERT KEY
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


async def main(port: str, target: str, cert: str, key: str) -> None:
    host, target_port = target.rsplit(":", 1)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["http/1.1"])

    async def serve(client_reader, client_writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(target_port))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, up_writer), pipe(up_reader, client_writer))
        for writer in (up_writer, client_writer):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", int(port), ssl=context)
    print(f"tls_forward: https://127.0.0.1:{port} -> http://{target}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    asyncio.run(main(*sys.argv[1:]))
