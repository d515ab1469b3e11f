// Command pause is the sandbox ("pause") container of the real node's pods: it holds the pod's
// namespaces and does nothing else until it is told to stop. registry.k8s.io/pause cannot be
// pulled here, so the lab packs this static binary as that image.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
}
