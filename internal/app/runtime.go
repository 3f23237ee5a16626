package app

import (
	"os"
	"runtime"

	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/config"
)

// ApplyRuntime sets the process's GOMAXPROCS from runtime.gomaxprocs,
// unless the GOMAXPROCS environment variable set it already. It changes
// the whole process, so only `walbox run` calls it (not Run, which tests
// call in-process).
func ApplyRuntime(rt config.Runtime, log zerolog.Logger) {
	if os.Getenv("GOMAXPROCS") != "" || rt.GOMAXPROCS <= 0 {
		log.Debug().Int("gomaxprocs", runtime.GOMAXPROCS(0)).Msg("GOMAXPROCS left as it is")
		return
	}
	prev := runtime.GOMAXPROCS(rt.GOMAXPROCS)
	log.Debug().Int("gomaxprocs", rt.GOMAXPROCS).Int("was", prev).Msg("GOMAXPROCS set from runtime.gomaxprocs")
}
