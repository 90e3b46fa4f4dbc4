"""Keys an operator can rotate: tenants' data key versions re-encrypted by a background job, wrapped
keys moved under a new master or KMS key, and tenants crypto-shredded (``service``); the columns of
sealed values a rotation rewrites (``inventory``)."""
