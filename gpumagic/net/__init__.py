"""The machine's way out: the laptop's proxy lent over SSH (:mod:`.proxy`), what the machine
can reach (:mod:`.doctor`), and the mirrors a machine in China needs (:mod:`.mirrors`).

The list of mirrors, the hosts kept direct and the upstreams measured are data
(``mirrors.json``, read by :mod:`.catalog`); what changes the machine's files is one
machine-side program (``remote/programs/net-settings.py``, run by :mod:`.settings`).
"""
