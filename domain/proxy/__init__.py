"""The outbound proxy: detokenization, request rules, transforms and pre-configured proxies.

Core document section 4 "Proxy" (rules 1-10), section 5 (``proxy:invoke``, ``token:<c>:use:proxy``),
section 7 (the ``proxy_error`` form) and section 8 (20 tokens per request).
"""
