// The differential suite's Node app (tests/it/attacks/differential.rs): Node's own `http` server and its
// `http2.createServer` (h2c, prior knowledge) on 127.0.0.1:0, one handler for both. It routes as Express's
// default router does: the method without case, the path without case and with an optional trailing
// slash (`caseSensitive: false`, `strict: false`). It prints its ports as a first JSON line, then one JSON
// line per handler execution: the handler, the method and request target as Node read them, and the
// headers and trailers it saw, once the body has ended (or failed).
'use strict';
const http = require('http');
const http2 = require('http2');

const ROUTES = [
  ['POST', '/payments', 'payments'],
  ['POST', '/webhooks/stripe', 'webhook'],
];

function route(method, url) {
  const path = url.split('?')[0].toLowerCase().replace(/(.)\/$/, '$1');
  const found = ROUTES.find(([m, p]) => m === method.toUpperCase() && p === path);
  return found ? found[2] : 'other';
}

function pairs(raw) {
  const out = [];
  for (let i = 0; i + 1 < raw.length; i += 2) out.push([raw[i].toLowerCase(), raw[i + 1]]);
  return out;
}

function handle(req, res) {
  const handler = route(req.method, req.url);
  let done = false;
  const finish = (bodyError) => {
    if (done) return;
    done = true;
    const record = {
      handler,
      method: req.method,
      target: req.url,
      headers: pairs(req.rawHeaders).filter(([name]) => !name.startsWith(':')),
      trailers: pairs(req.rawTrailers || []),
      body_error: bodyError,
    };
    process.stdout.write(JSON.stringify(record) + '\n');
    if (!bodyError) {
      const body = JSON.stringify({ app: 'node', handler });
      res.writeHead(200, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) });
      res.end(body);
    }
  };
  req.on('data', () => {});
  req.on('end', () => finish(null));
  req.on('error', (error) => finish(String(error)));
  req.on('aborted', () => finish('aborted'));
}

const h1 = http.createServer(handle);
const h2 = http2.createServer({}, handle);
h1.listen(0, '127.0.0.1', () => {
  h2.listen(0, '127.0.0.1', () => {
    const listen = { http1: h1.address().port, h2c: h2.address().port };
    process.stdout.write(JSON.stringify({ listen }) + '\n');
  });
});
