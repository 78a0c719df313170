"""The cluster adapter: etcd events and peer requests turned into store calls.

The counterpart of fs/ for other nodes: core.py holds membership, the peer server and
client and the namespace plumbing; each kind has a module (buffers.py, weights.py,
checkpoints.py, datasets.py) that daemon.py hands to the core. Only with
`distore mount --cluster`.
"""
