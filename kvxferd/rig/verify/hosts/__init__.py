"""Many hosts on one machine: network namespaces, the chart's policy as packet filters, link faults (root only)."""
