"""The same-host transport: one AF_UNIX connection per peer pair in the job's private
directory, admitted by peer credentials and a secret-keyed challenge, with large frames in
shared-memory segments.
"""
