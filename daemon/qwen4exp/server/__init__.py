"""The daemon's HTTP side (aiohttp) and its supervised engine worker process."""
