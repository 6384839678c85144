"""The request bodies of the HTTP routes that only the API reads (a job's spec, read by ``rloo train``
too, is ``service.jobs.spec``)."""
