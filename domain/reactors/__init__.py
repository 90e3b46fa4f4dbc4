"""Reactors: customer code run on the platform's Node.js 22 runtime (core spec sections 2, 4, 7-9)."""
