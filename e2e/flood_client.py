"""An open-loop flood of new session ids at a router, in a process of its own.

Used by e2e/test_router.py: the flood's client makes thousands of requests a second,
and in the test's own process it would slow the test's other client (the established
session's turns, which the test times) as much as the router does.

    python -P e2e/flood_client.py URL RATE SECONDS REQUEST-BODY-JSON

Prints one JSON object: each request's status, in order, and how long the flood lasted.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp


async def flood(url: str, body: dict[str, object], rate: int, seconds: int) -> dict[str, object]:
    """Send ``rate`` requests a second for ``seconds``, each with a new session id."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as http:

        async def one(n: int) -> int:
            async with http.post(
                f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": f"flood-{n}"}
            ) as answer:
                await answer.read()
                return answer.status

        tasks = []
        start = time.monotonic()
        for n in range(rate * seconds):
            # Open loop: each request leaves at its time, whatever the answers do.
            delay = start + n / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(n)))
        statuses = list(await asyncio.gather(*tasks))
        return {"statuses": statuses, "seconds": time.monotonic() - start}


def main() -> int:
    """Flood, then print the outcome."""
    url, rate, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    body = json.loads(sys.argv[4])
    print(json.dumps(asyncio.run(flood(url, body, rate, seconds))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
