"""The batch service (issue 17): OpenAI's Batch API over the mesh; pure cores in job.py, lines.py, dispatch.py."""
