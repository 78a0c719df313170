"""Thin adapters from RL libraries to distorefs buffers, one module per library, each an
optional extra. They use only the mount's files and the formats of docs/namespace.md
(`config`, `append`, `sample.N`, `priority`, `stats`), so a user could write them."""
