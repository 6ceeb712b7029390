"""Imported first by the forkserver that starts a pipeline's ranks (pipeline/start_method.py): SIGINT
ignored from here on. A Ctrl-C at the terminal reaches the launcher, the server and the ranks
alike; the launcher stops the run and says so, while the server, importing torch for seconds, and a
rank still being set up would each print a KeyboardInterrupt traceback. The server's children
inherit the setting; a rank takes Ctrl-C back (``default_int_handler``) once its own handling is
in place, unless the launcher ignores it too."""
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
