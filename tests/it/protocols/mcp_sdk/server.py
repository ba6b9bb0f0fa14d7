# An MCP server (the official Python SDK's) with one tool that counts its executions. Serves Streamable
# HTTP on 127.0.0.1 at a port the OS picks, printed as "PORT <n>"; answers JSON with argv[1] == "json",
# else the SDK's default, an event stream once the tool reports progress.
import socket
import sys

import uvicorn
from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("counter")
executions = 0


@server.tool()
async def charge(amount: int, ctx: Context) -> str:
    """Charges amount; says which execution this is."""
    global executions
    executions += 1
    await ctx.report_progress(1, 1)
    return f"charged {amount}: execution {executions}"


app = server.streamable_http_app(json_response=sys.argv[1] == "json", stateless_http=True)
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
print("PORT", listener.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])
