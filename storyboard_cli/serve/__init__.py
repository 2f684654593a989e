"""Stage serve: the render service (HTTP API, durable queue, workers); above run/, below the commands."""
