// The program every sandboxed Node.js process runs (infra/node_runtime/process.py starts it inside
// bubblewrap, infra/node_runtime/sandbox.py).
//
// argv[2] is the customer code's file, argv[3] the egress proxy's unix socket. The code is loaded
// once; then each line read on stdin is one invocation {"id": n, "payload": ...}; the exported async function is called with the payload and
// one line is written on stdout per invocation:
//   {"id": n, "ok": true, "value": <what the function returned, JSON>, "timers": k}
//   {"id": n, "ok": false, "error": {"name", "message", "errors", "marked"}, "timers": k}
// "timers" counts the timers the code left running when it answered: the process is then ended
// rather than kept warm (code must not run between invocations).
// The first line written is {"ready": true}, or {"load_error": {"kind", "name", "message", "line"}} when
// the code does not load or does not export a function (the process then exits; "line": where a syntax
// error is, else null).
// An error carrying Symbol.for('tessera.error') (the classes of a module the platform ships) is
// "marked": its message and errors are the code's answer to the caller. Of any other thrown value
// the name and the first line of its message (at most MAX_MESSAGE characters) are passed on, so a
// developer can act on it; every string of the request (and every number of 4 digits or more) the
// message quotes is replaced by [redacted] first, since it may quote the data the code was given.
// The customer's console output goes to stderr, never into the protocol.
//
// Egress: the process has no network but its own loopback. fetch and the http/https modules'
// global agents open each connection as a CONNECT tunnel through the worker's egress proxy, on the
// unix socket named by argv[3]; the proxy decides which destinations may be reached.
'use strict';

const { Console } = require('node:console');
const net = require('node:net');
const tls = require('node:tls');
const http = require('node:http');
const https = require('node:https');

const MARK = Symbol.for('tessera.error');
const write = process.stdout.write.bind(process.stdout);
const quiet = new Console({ stdout: process.stderr, stderr: process.stderr });
globalThis.console = quiet;

// ---- egress ---------------------------------------------------------------------------------------

const EGRESS = process.argv[3];
const MAX_ANSWER_HEAD = 8192;

function tunnel(host, port, callback) {
  const sock = net.connect(EGRESS);
  let settled = false;
  const fail = (err) => {
    if (settled) return;
    settled = true;
    sock.destroy();
    callback(err);
  };
  sock.once('error', fail);
  sock.once('connect', () => {
    const target = net.isIPv6(host) ? `[${host}]:${port}` : `${host}:${port}`;
    sock.write(`CONNECT ${target} HTTP/1.1\r\nHost: ${target}\r\n\r\n`);
  });
  let head = Buffer.alloc(0);
  const onData = (chunk) => {
    head = Buffer.concat([head, chunk]);
    const end = head.indexOf('\r\n\r\n');
    if (end < 0) {
      if (head.length > MAX_ANSWER_HEAD) fail(new Error('the egress proxy answered too long a head'));
      return;
    }
    sock.removeListener('data', onData);
    const text = head.subarray(0, end).toString('latin1');
    const status = /^HTTP\/1\.[01] (\d{3})/.exec(text);
    if (!status || status[1] !== '200') {
      const said = head.subarray(end + 4).toString('utf8');
      const reason = text.split('\r\n')[0] + (said ? ` (${said})` : '');
      const err = new Error(`connection to ${host}:${port} refused by the sandbox: ${reason}`);
      err.code = 'ECONNREFUSED';
      fail(err);
      return;
    }
    const rest = head.subarray(end + 4);
    if (rest.length) sock.unshift(rest);
    settled = true;
    sock.removeListener('error', fail);
    callback(null, sock);
  };
  sock.on('data', onData);
}

function secure(raw, options, callback) {
  const servername = options.servername || (net.isIP(options.host) ? undefined : options.host);
  const socket = tls.connect({ ...options, socket: raw, servername });
  socket.once('secureConnect', () => callback(null, socket));
  socket.once('error', (err) => callback(err));
}

class TunnelAgent extends http.Agent {
  createConnection(options, callback) {
    tunnel(options.host, options.port || 80, callback);
  }
}

class TunnelTlsAgent extends https.Agent {
  createConnection(options, callback) {
    tunnel(options.host, options.port || 443, (err, raw) => (err ? callback(err) : secure(raw, options, callback)));
  }
}

function routeEgress() {
  http.globalAgent = new TunnelAgent({ keepAlive: true });
  https.globalAgent = new TunnelTlsAgent({ keepAlive: true });
  // Loading fetch installs Node's default dispatcher; a dispatcher of the same class with our
  // connector replaces it, so every fetch opens its connections through the tunnel.
  fetch('data:,').catch(() => {});
  const key = Symbol.for('undici.globalDispatcher.1');
  const Dispatcher = globalThis[key].constructor;
  globalThis[key] = new Dispatcher({
    connect(options, callback) {
      const https = options.protocol === 'https:';
      const port = Number(options.port) || (https ? 443 : 80);
      tunnel(options.hostname, port, (err, raw) => {
        if (err) return callback(err);
        if (!https) return callback(null, raw);
        return secure(raw, { host: options.hostname, servername: options.servername, ALPNProtocols: ['http/1.1'] },
          callback);
      });
    },
  });
}

if (EGRESS) routeEgress();

// ---- the protocol ---------------------------------------------------------------------------------

function timers() {
  return process.getActiveResourcesInfo().filter((name) => name === 'Timeout' || name === 'Immediate').length;
}

function send(message) {
  let line;
  try {
    line = JSON.stringify(message);
  } catch (err) {
    line = JSON.stringify({
      id: message.id,
      ok: false,
      error: { name: 'TypeError', message: `the result is not JSON: ${err.message}`, marked: false, result: true },
      timers: message.timers,
    });
  }
  write(line + '\n');
}

const MAX_MESSAGE = 500;
const MIN_SECRET = 4;

function secrets(value, found = new Set()) {
  if (typeof value === 'string') {
    if (value.length >= MIN_SECRET) found.add(value);
  } else if (typeof value === 'number' || typeof value === 'bigint') {
    const text = String(value);
    if (text.length >= MIN_SECRET) found.add(text);
  } else if (value !== null && typeof value === 'object') {
    for (const item of Object.values(value)) secrets(item, found);
  }
  return found;
}

function unmarkedMessage(err, payload) {
  let text;
  try {
    text = err !== null && typeof err === 'object' ? err.message : err;
    text = text === undefined || text === null ? '' : String(text);
  } catch (e) {
    return '';
  }
  const longestFirst = [...secrets(payload)].sort((a, b) => b.length - a.length);
  for (const secret of longestFirst) text = text.split(secret).join('[redacted]');
  text = text.split(/\r?\n|\r/, 1)[0] || '';
  return text.length > MAX_MESSAGE ? `${text.slice(0, MAX_MESSAGE - 1)}\u2026` : text;
}

function describe(err, payload) {
  if (err !== null && typeof err === 'object' && err[MARK] === true) {
    return { name: String(err.name), message: String(err.message), errors: err.errors ?? null, marked: true };
  }
  const name = err !== null && typeof err === 'object' && typeof err.name === 'string' ? err.name : typeof err;
  return { name, message: unmarkedMessage(err, payload), errors: null, marked: false };
}

let handler;
try {
  const exported = require(process.argv[2]);
  handler = typeof exported === 'function' ? exported
    : exported !== null && typeof exported === 'object' && typeof exported.default === 'function' ? exported.default
      : null;
  if (handler === null) {
    send({ load_error: { kind: 'not_a_function', name: typeof exported, message: 'the module does not export a function' } });
    process.exit(3);
  }
} catch (err) {
  const kind = err instanceof SyntaxError ? 'syntax' : 'load';
  // A syntax error's stack starts with "<file>:<line>": the line is kept, the file (ours) is not.
  const at = kind === 'syntax' && typeof err.stack === 'string' ? /^[^\n]*:(\d+)\n/.exec(err.stack) : null;
  send({ load_error: { kind, name: err && err.name ? String(err.name) : typeof err, message: err && err.message ? String(err.message) : '',
    line: at ? Number(at[1]) : null } });
  process.exit(3);
}

async function run(id, payload) {
  try {
    const value = await handler(payload);
    send({ id, ok: true, value: value === undefined ? null : value, timers: timers() });
  } catch (err) {
    send({ id, ok: false, error: describe(err, payload), timers: timers() });
  }
}

let buffered = '';
process.stdin.setEncoding('utf8');
process.stdin.on('data', (chunk) => {
  buffered += chunk;
  let end;
  while ((end = buffered.indexOf('\n')) >= 0) {
    const line = buffered.slice(0, end);
    buffered = buffered.slice(end + 1);
    const frame = JSON.parse(line);
    run(frame.id, frame.payload);
  }
});
process.stdin.on('end', () => process.exit(0));
send({ ready: true });
