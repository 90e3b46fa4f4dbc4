"""Customer code on Node.js 22: the executable (``binary``), the confinement of its processes
(``sandbox``), one process fed over a pipe (``process``), the pool of warm processes (``pool``) and
npm dependencies, installed once per set and scanned for known vulnerabilities (``packages``).
Reactor-specific rules (the request object, the error classes and their statuses) live in
``domain.reactors.runtime``."""
