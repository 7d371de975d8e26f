"""Reusable widgets, one a file: header, prompt bar, request table, KV bar, throughput, top-k bars, block grid, heatmap."""
